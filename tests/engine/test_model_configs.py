"""config.json as people write it, not only as transformers 5 saves it: classic keys
(rope_scaling, top-level rope_theta and original_max_position_embeddings), keys left out
(each family's own defaults, not Llama's), keys a family ignores, and aliases. Each case edits
a saved random-weight checkpoint's config.json, reloads it in transformers, and compares the
logits of a 30-token prompt (two chunks) with tinyserve's (fp32, relative L2 < 1e-4)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.engine.test_families import build, prompt  # noqa: E402
from tests.engine.test_model_vs_transformers import rel_l2, run_chunk  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0}
LONG = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
        "long_factor": [1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]}


def _drop(*keys):
    return lambda raw: [raw.pop(k, None) for k in keys]


def _rope_scaling_added(raw):  # a user adds YaRN the classic way to a transformers-5 config
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _classic_yarn_without_original(raw):
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})


def _top_level_original(raw):  # transformers: the top-level value wins for yarn / longrope
    raw["original_max_position_embeddings"] = 24


def _phi3_su(raw):  # Phi-3's old name for LongRoPE
    raw["rope_parameters"]["rope_type"] = "su"


# (label, architecture, config, edit of config.json)
CASES = [
    ("rope_scaling wins over rope_parameters", "Qwen3ForCausalLM",
     dict(SMALL, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     _rope_scaling_added),
    ("yarn without original length: max_position_embeddings", "Qwen2ForCausalLM",
     dict(SMALL, rope_parameters=YARN), _classic_yarn_without_original),
    ("top-level original length wins (yarn)", "Qwen2ForCausalLM",
     dict(SMALL, rope_parameters=YARN), _top_level_original),
    ("top-level original length wins (longrope)", "Phi3ForCausalLM",
     dict(SMALL, rope_parameters=LONG), _top_level_original),
    ("Phi-3 'su' is longrope", "Phi3ForCausalLM", dict(SMALL, rope_parameters=LONG), _phi3_su),
    ("Gemma 2 without soft-cap keys: 50 / 30", "Gemma2ForCausalLM",
     dict(SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
     _drop("attn_logit_softcapping", "final_logit_softcapping")),
    ("Gemma 2 without query_pre_attn_scalar or activation", "Gemma2ForCausalLM",
     dict(SMALL, head_dim=16, sliding_window=8),
     _drop("query_pre_attn_scalar", "hidden_activation", "hidden_act")),
    ("Qwen3 without head_dim: 128", "Qwen3ForCausalLM", dict(SMALL, head_dim=128),
     _drop("head_dim")),
    ("a Llama's sliding_window is ignored", "LlamaForCausalLM", dict(SMALL),
     lambda raw: raw.update(sliding_window=8)),
    ("Qwen2 layer_types without use_sliding_window: no window", "Qwen2ForCausalLM",
     dict(SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0),
     lambda raw: raw.update(use_sliding_window=False,
                            layer_types=["sliding_attention", "full_attention"])),
]


def _reference(path, ids, name):
    cfg = transformers.AutoConfig.from_pretrained(path)
    if name.startswith("Qwen2 layer_types"):  # transformers nulls the window, then cannot run:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers  # what it means
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name,arch,kw,edit", CASES, ids=[c[0] for c in CASES])
def test_config_variants_compute_what_transformers_computes(tmp_path, name, arch, kw, edit):
    from tests.engine import test_families

    test_families.CONFIGS["_variant"] = (arch, kw)
    try:
        build("_variant", tmp_path)
    finally:
        del test_families.CONFIGS["_variant"]
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    # (within the original length where it matters: LongRoPE's per-position tables differ from
    # transformers' whole-sequence choice past it, docs/limits.md)
    ids = prompt(11, 20 if "longrope" in name else 30)
    ref = _reference(tmp_path, ids, name)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=16)
    got = torch.cat([run_chunk(llm.engine, 0, ids[:12], 0, [1, 2]),
                     run_chunk(llm.engine, 0, ids, 12, [1, 2])])
    assert rel_l2(got, ref) < 1e-4, (name, rel_l2(got, ref))


def test_what_the_variants_read():
    """The numbers behind the cases above, read without running anything."""
    from pathlib import Path

    from tinyserve.engine.loading.model_config import model_config_from

    where = Path("config.json")
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2,
                vocab_size=300)
    g2 = model_config_from({**base, "architectures": ["Gemma2ForCausalLM"]}, {}, where)
    assert (g2.attn_softcap, g2.final_softcap, g2.head_dim) == (50.0, 30.0, 256)
    assert g2.attn_scale == pytest.approx(256 ** -0.5) and g2.activation == "gelu_tanh"
    llama = model_config_from({**base, "architectures": ["LlamaForCausalLM"],
                               "sliding_window": 8}, {}, where)
    assert llama.window(0) is None
    yarn = model_config_from({**base, "architectures": ["Qwen2ForCausalLM"],
                              "max_position_embeddings": 96,
                              "rope_scaling": {"type": "yarn", "factor": 2.0}}, {}, where)
    assert yarn.rope_scaling["original_max_position_embeddings"] == 96
    phi = model_config_from({**base, "architectures": ["Phi3ForCausalLM"],
                             "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                              "long_factor": [2.0] * 8}}, {}, where)
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 4096  # Phi3Config's
