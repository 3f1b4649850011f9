"""Every family the model description covers, against transformers, on random-weight
checkpoints built here (no hub): Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 (text), Phi-3. Llama
has its own file (test_model_vs_transformers.py).

Two configs per family with awkward sizes (odd head counts, GQA 3:1 and 1:1, head_dims that
are not 64 or 128, head_dim 256, windows shorter than the prompt, soft-caps on, each rope
scaling). Per config, in fp32:

- the runner's logits over a prefill and decode steps vs transformers' full-sequence logits,
  relative L2 < 1e-4 (the Llama tests' bound) and every logprob within 2e-4;
- ``LLM.generate``: greedy 32 tokens equal to ``transformers.generate``, with chunked
  prefill, a prefix-cache hit and a preemption in the same run; the chosen tokens' logprobs
  and the top 5 equal to transformers' log-softmax over the whole vocabulary;
- the same through the HTTP server, quantized, and windowed over a long sequence:
  tests/server/test_families_serving.py.

dynamic and longrope ropes depend on the sequence length in transformers (rope.py): their
full-sequence logits are compared within the original length, and generation (one token a
step in both) past it; Phi-3's ``generate`` re-prefills when crossing (see REPREFILLS).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.engine.test_model_vs_transformers import rel_l2, run_chunk  # noqa: E402
from tinyserve.engine.loading.demo import write_tokenizer  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402
from tinyserve.messages import SamplingParams  # noqa: E402

BLOCK = 16
COMMON = dict(vocab_size=300, num_hidden_layers=2, max_position_embeddings=128,
              initializer_range=0.15,
              # the demo tokenizer's specials, so min_tokens bans the same EOS in both
              bos_token_id=256, eos_token_id=257, pad_token_id=258)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
CONFIGS = {
    # GQA 3:1, q/k/v bias (always, in Qwen2), rope theta 1e6
    "qwen2_gqa3": ("Qwen2ForCausalLM", dict(
        hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # 1:1, a window on the second layer only (max_window_layers 1), YaRN
    "qwen2_window_yarn": ("Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
        use_sliding_window=True, sliding_window=24, max_window_layers=1, rope_parameters=YARN)),
    # q/k norm, head_dim 24 (not hidden / heads), GQA 3:1
    "qwen3_gqa3": ("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # attention_bias (q/k/v/o), head_dim 40, dynamic NTK past 64 positions
    "qwen3_bias_dynamic": ("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4,
        head_dim=40, attention_bias=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    # every layer windowed (v0.1 style): blocks behind the window are given back
    "mistral_window": ("MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
        sliding_window=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # explicit head_dim (4 x 24 != 64), linear rope, no window
    "mistral_headdim_linear": ("MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
        head_dim=24, sliding_window=None,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # alternate sliding layers, both soft-caps, query_pre_attn_scalar != head_dim
    "gemma2_softcap": ("Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=24, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # head_dim 256, GQA 2:1
    "gemma2_hd256": ("Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, sliding_window=24, query_pre_attn_scalar=256)),
    # local / global layers with their own ropes (global: linear x8), q/k norm
    "gemma3_local_global": ("Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # the final soft-cap on (an attention soft-cap in the config, which Gemma 3 ignores),
    # GQA 3:1, head_dim 48
    "gemma3_softcap": ("Gemma3ForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
        head_dim=48, sliding_window=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0, layer_types=["full_attention", "sliding_attention"])),
    # fused qkv / gate_up, partial rotary (8 of 16 dims), GQA 2:1
    "phi3_partial": ("Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})),
    # LongRoPE (long factors from position 48), a window on every layer
    "phi3_longrope_window": ("Phi3ForCausalLM", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=3,
        sliding_window=24, original_max_position_embeddings=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                         "long_factor": [1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0],
                         "original_max_position_embeddings": 48})),
}
# a rope that depends on the sequence length: full-sequence logits only within this length
LENGTH_DEPENDENT = {"qwen3_bias_dynamic": 64, "phi3_longrope_window": 48}


def build(name: str, path, configs: dict | None = None, common: dict | None = None,
          perturb=None) -> "transformers.PreTrainedModel":
    """The random-weight checkpoint ``name`` of ``configs`` (this file's by default) saved at
    ``path`` with the demo tokenizer; ``perturb(name, param)`` may change a parameter more."""
    arch, kw = (configs or CONFIGS)[name]
    cls = getattr(transformers, arch)
    cfg = cls.config_class(**{**(common or COMMON), **kw})
    torch.manual_seed(sum(map(ord, name)))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from their zero / one init, so they matter
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            if perturb is not None:
                perturb(n, p)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, path), path


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()  # bytes, no specials


def test_logits_match_transformers_over_prefill_and_decode(family):
    name, hf, path = family
    check_logits(name, hf, path, min(44, LENGTH_DEPENDENT.get(name, 128)))


def check_logits(name: str, hf, path, length: int, quantization: str | None = None) -> None:
    """A prefill in two chunks (the second starting mid-block) and three decode steps: relative
    L2 < 1e-4 against transformers' full-sequence logits, every logprob within 2e-4."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=BLOCK,
              quantization=quantization)
    ids = prompt(1, length)
    n = len(ids) - 3
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    blocks = [7, 2, 9, 4]  # scattered physical blocks
    got = [run_chunk(llm.engine, 0, ids[:20], 0, blocks),
           run_chunk(llm.engine, 0, ids[:n], 20, blocks)]
    for pos in range(n, len(ids)):  # decode steps, one token each
        got.append(run_chunk(llm.engine, 0, ids[:pos + 1], pos, blocks))
    got = torch.cat(got)
    err = rel_l2(got, ref)
    assert err < 1e-4, f"{name}: relative L2 {err:.2e}"
    # and per token: an error in a few rows (a soft-cap applied where it is not) hides in L2
    lp_err = (torch.log_softmax(got.double(), -1) - torch.log_softmax(ref.double(), -1)).abs()
    assert lp_err.max() < 2e-4, f"{name}: logprob error {lp_err.max():.2e}"


# Phi-3's generate drops its cache when a sequence crosses the original length and recomputes
# it with the long factors: a per-request re-prefill this server does not do (rope.py)
REPREFILLS = {"phi3_longrope_window"}


def hf_greedy(hf, ids: list[int], n: int, loop: bool = False) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (EOS banned, as min_tokens does) and the raw log-softmax
    each was chosen from: ``generate``, or with ``loop`` a prefill and one step at a time on its
    cache, where its rope picks the factors per step as the tables do."""
    with torch.no_grad():
        if not loop:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=258, output_logits=True,
                              return_dict_in_generate=True)
            rows = torch.stack(out.logits)[:, 0].double()
            return out.sequences[0, len(ids):].tolist(), torch.log_softmax(rows, -1)
        logits, out, cache, step = [], list(ids), None, torch.tensor([ids])
        for _ in range(n):
            res = hf(step, cache=cache, use_cache=True)
            cache, row = res.cache, res.logits[0, -1].double()
            logits.append(row)
            banned = row.clone()
            banned[257] = float("-inf")
            out.append(int(banned.argmax()))
            step = torch.tensor([[out[-1]]])
    return out[len(ids):], torch.log_softmax(torch.stack(logits), -1)


def check_logprobs(name: str, token_ids, logprobs, rows: torch.Tensor, k: int) -> None:
    """Each chosen token's logprob and the top k equal to transformers' full-vocabulary
    log-softmax rows (fp32 sums: a relative term for soft-capped, large logits)."""
    for i, (tok, entry) in enumerate(zip(token_ids, logprobs, strict=True)):
        row = rows[i]
        top = row.topk(k)
        want = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        want[tok] = float(row[tok])
        assert set(entry) == set(want), (name, i)
        for t, lp in entry.items():
            assert abs(lp - want[t]) < 2e-4 + 1e-4 * abs(want[t]), (name, i, t, lp, want[t])


def test_greedy_generation_and_logprobs_through_llm(family):
    """Chunked prefill (16-token budget), a prefix-cache hit and a preemption in one run: 5
    blocks of 16 hold one 72-token sequence, not two batched together (nor, with a window of
    24 on every layer, two windows and their steps)."""
    name, hf, path = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=5, block_size=BLOCK, max_model_len=80,
              max_num_batched_tokens=16, max_num_seqs=3)
    first = prompt(2, 40)
    shared = first[:32] + prompt(3, 8)  # two full blocks in common with `first`
    params = SamplingParams(max_tokens=32, temperature=0.0, min_tokens=32, logprobs=5)
    llm.generate([first], SamplingParams(max_tokens=1))  # fills the prefix cache
    outs = llm.generate([shared, first], params)
    assert llm.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert outs[0].num_cached_tokens >= 32, "the shared prefix was meant to hit the cache"
    for ids, out in zip([shared, first], outs, strict=True):
        tokens, rows = hf_greedy(hf, ids, 32, loop=name in REPREFILLS)
        assert list(out.token_ids) == tokens, name
        check_logprobs(name, out.token_ids, out.logprobs, rows, 5)


def test_loader_reads_the_family_switches(family):
    """What the description says for each config (the numbers tests above rest on)."""
    from tinyserve.engine.loading.model_config import load_model_config

    name, hf, path = family
    cfg = load_model_config(path)
    raw = json.loads((path / "config.json").read_text())
    assert cfg.architecture == CONFIGS[name][0]
    assert cfg.head_dim == hf.config.head_dim if hasattr(hf.config, "head_dim") else True
    if name.startswith("gemma"):
        assert cfg.norm_unit_offset and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
        assert cfg.attn_scale == pytest.approx(raw["query_pre_attn_scalar"] ** -0.5)
    if name.startswith("qwen2"):
        assert cfg.qkv_bias and not cfg.o_bias
    if name.startswith("qwen3") or name.startswith("gemma3"):
        assert cfg.qk_norm
    if name == "gemma2_softcap":
        assert (cfg.attn_softcap, cfg.final_softcap) == (5.0, 3.0)
    if name == "gemma3_softcap":  # transformers' Gemma 3 never applies the attention soft-cap
        assert (cfg.attn_softcap, cfg.final_softcap) == (None, 15.0)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    hf_windows = [hf.config.sliding_window if t == "sliding_attention" else None
                  for t in (getattr(hf.config, "layer_types", None)
                            or (["sliding_attention"] * cfg.num_layers
                                if getattr(hf.config, "sliding_window", None) else
                                ["full_attention"] * cfg.num_layers))]
    assert windows == hf_windows, name
