"""GGUF files of every supported family, written here from random-weight transformers models
the way llama.cpp's converter writes them (tests/gguf_writer.py), in F16, Q8_0, Q4_0, Q4_1,
Q4_K and Q6_K (a Q4_K_M-like mix too): each loads, reads the config the model's Hugging Face
directory gives, and its logits over a chunked prefill equal transformers' load of the same
file (its dequantized fp32 weights), with the weights kept in their GGUF forms and with
``dequantize``. (transformers is given the original config: its GGUF reader leaves some keys,
like Qwen3's head_dim, at their class defaults.)"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

from tests.engine import test_families as fam  # noqa: E402
from tests.engine.test_model_vs_transformers import rel_l2, run_chunk  # noqa: E402
from tests.gguf_writer import Q, write_model  # noqa: E402
from tinyserve.engine.loading.model_config import load_model_config  # noqa: E402
from tinyserve.engine.model.weights import Int4Linear, Int8GroupLinear, Linear  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
# K-quants need rows of whole 256-blocks: every linear layer's input
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)
CONFIGS = {
    "llama": ("LlamaForCausalLM", dict(SIZES, rope_parameters=ROPE, tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(SIZES, rope_parameters=dict(ROPE, rope_theta=1e6))),
    "qwen3": ("Qwen3ForCausalLM", dict(SIZES, head_dim=32, rope_parameters=ROPE)),
    "gemma2": ("Gemma2ForCausalLM", dict(SIZES, head_dim=32, query_pre_attn_scalar=32,
                                         sliding_window=24, attn_logit_softcapping=20.0,
                                         final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(SIZES, head_dim=32, query_pre_attn_scalar=32,
                                         num_hidden_layers=3, sliding_window=24,
                                         sliding_window_pattern=3)),
    "phi3": ("Phi3ForCausalLM", dict(SIZES, pad_token_id=258,
                                     rope_parameters=dict(ROPE, partial_rotary_factor=0.5))),
    "llama_wide": ("LlamaForCausalLM", dict(WIDE, rope_parameters=ROPE)),
}
MIXED = "Q4_K_M-like"  # Q4_K, with attn_v, ffn_down and the LM head in Q6_K
CASES = [("llama", "F16"), ("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"),
         ("gemma2", "Q4_1"), ("gemma3", "Q8_0"), ("phi3", "Q4_0"), ("phi3", "F16"),
         ("llama_wide", "Q4_K"), ("llama_wide", "Q6_K"), ("llama_wide", MIXED)]


def _types(cfg, qtype: str):
    if qtype != MIXED:
        return getattr(Q, qtype), None
    six = {f"blk.{i}.{n}.weight": Q.Q6_K for i in range(cfg.num_hidden_layers)
           for n in ("attn_v", "ffn_down")}
    return Q.Q4_K, {**six, "output.weight": Q.Q6_K}


@pytest.mark.parametrize("name,qtype", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_gguf_file_matches_transformers_load_of_it(tmp_path, name, qtype):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    fam.CONFIGS[name] = CONFIGS[name]
    try:
        hf = fam.build(name, tmp_path)
    finally:
        del fam.CONFIGS[name]
    main, types = _types(hf.config, qtype)
    path = write_model(hf, tmp_path, tmp_path / "model.gguf", main, types)
    ours, theirs = load_model_config(path), load_model_config(tmp_path)
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                  "rotary_dim", "qkv_bias", "qk_norm", "norm_unit_offset", "activation",
                  "attn_softcap", "final_softcap", "tie_word_embeddings", "local_rope_theta"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.attn_scale == pytest.approx(theirs.attn_scale)
    assert [ours.window(i) for i in range(ours.num_layers)] == \
        [theirs.window(i) for i in range(theirs.num_layers)]

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", config=hf.config, dtype=torch.float32,
        attn_implementation="eager").eval()
    ids = fam.prompt(1, 40)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    kinds = set()
    for dequantize in (False, True):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=16, block_size=16,
                  dequantize=dequantize)
        got = torch.cat([run_chunk(llm.engine, 0, ids[:20], 0, [1, 2, 3]),
                         run_chunk(llm.engine, 0, ids, 20, [1, 2, 3])])
        assert rel_l2(got, ref) < 1e-4, (name, qtype, dequantize, rel_l2(got, ref))
        w = llm.engine.runner.model.w
        kinds |= {type(x).__name__ for layer in w.layers for x in (layer.qkv, layer.down)}
        assert (w.quantization == "gguf") == (not dequantize)
    expected = {"F16": {Linear}, "Q8_0": {Int8GroupLinear}, "Q6_K": {Int8GroupLinear},
                MIXED: {Int8GroupLinear}}.get(qtype, {Int4Linear})
    assert kinds == {"Linear"} | {k.__name__ for k in expected}  # kept, and dequantized
