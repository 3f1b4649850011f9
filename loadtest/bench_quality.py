"""Quality and capacity of every weight format x KV dtype on stories260k, side by side.

    python loadtest/bench_quality.py [--budget 8MiB] [--seq-len 512] [--markdown]
    python loadtest/bench_quality.py --family qwen3|gemma2|qwen3moe [--markdown]

For fp32 and fp16 weights, int8 (per channel) and int4 (group 128) weights, each with the
model-dtype KV cache and the int8 one, it reports against fp32 (teacher-forced, tinyserve/
quality.py): next-token agreement and mean |delta logprob| over the reference text
(reference.json: transformers' greedy output, 52 predictions) and over four sampled
continuations (temperature 0.8, ~830 predictions, where the model is less sure); weight bytes;
KV bytes per token; and how many --seq-len-token sequences fit one memory budget holding the
weights and the KV cache (as the block pool would size it: whole blocks per sequence).

``--family``: the same matrix on a random-weight Qwen3, Gemma 2 or Qwen3-MoE checkpoint built
here with transformers (FAMILY_CONFIGS: q/k norm and GQA; sandwich norms, soft-caps and a window
shorter than the texts; 16 experts, top 4, int8 experts kept int8), whose texts are the fp32
model's own samples: no trained weights of these families can be downloaded here, so the
numbers measure numerics on an untrained model.

A benchmark: it prints, it asserts nothing (the acceptance bounds live in tests/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (no-op on a GPU box)
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/ is not a package on the path

PROMPTS = ("Once upon a time", "Tom and Sue went to the", "The little dog", "One day, a bird")
CONFIGS = [  # (row label, LLM keyword arguments)
    ("fp32", {}),
    ("fp16", {"dtype": "float16"}),
    ("int8 weights", {"quantization": "int8"}),
    ("int4 weights (g128)", {"quantization": "int4"}),
]


_FAMILY_COMMON = dict(vocab_size=300, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, initializer_range=0.05,
                      bos_token_id=256, eos_token_id=257, pad_token_id=258)
FAMILY_CONFIGS = {
    "qwen3": ("Qwen3ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6})),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=64, query_pre_attn_scalar=64,
                                         attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0)),
    # every layer sparse: 16 experts of 128, top 4 renormalised (int4 experts: refused)
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=4,
                                              moe_intermediate_size=128, norm_topk_prob=True,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e6})),
}


def family_checkpoint(family: str, path) -> str:
    """A random-weight checkpoint of ``family`` (transformers' init, norms perturbed so they
    matter) with the demo byte tokenizer, written to ``path``."""
    import torch
    import transformers

    from tinyserve.engine.loading.demo import write_tokenizer

    arch, kw = FAMILY_CONFIGS[family]
    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        cls.config_class(**{**_FAMILY_COMMON, **kw}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    write_tokenizer(Path(path))
    return str(path)


def texts(llm, family: str | None = None) -> list[list[int]]:
    """The reference text (stories260k), then sampled continuations written by the fp32 model
    itself."""
    from tinyserve.messages import SamplingParams
    from tinyserve.models import STORIES260K

    out = []
    if family is None:
        ref = json.loads((STORIES260K / "reference.json").read_text())
        out.append(ref["prompt_token_ids"] + ref["greedy_new_token_ids"])
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=1, ignore_eos=True)
    for o in llm.generate(list(PROMPTS), params):
        out.append(list(o.prompt_token_ids) + list(o.token_ids))
    return out


def llama3_8b_rows(budget: int, seq_len: int) -> list[dict]:
    """The same capacity arithmetic at Llama-3-8B's shapes (bf16 activations), computed from
    the byte formulas (Linear / Int4Linear storage, KVCacheSpec), not measured: no GPU here."""
    import torch

    from tinyserve.engine.model.kv_cache import KVCacheSpec

    L, D, Hq, Hk, Dh, I, V = 32, 4096, 32, 8, 128, 14336, 128256
    outs = (Hq * Dh + 2 * Hk * Dh, D, 2 * I, D)  # fused qkv, o, gate_up, down
    ins = (D, Hq * Dh, D, I)
    params = L * sum(o * i for o, i in zip(outs, ins))
    rest = (2 * V * D + (2 * L + 1) * D) * 2  # embedding, LM head, norms: bf16
    weights = {
        "bf16": params * 2 + rest,
        "int8 weights": params + L * sum(outs) * 4 + rest,  # + an fp32 scale per row
        "int4 weights (g128)": params // 2 + params // 128 * 3 + rest,  # + fp16 scale, u8 zero
    }
    rows = []
    for label, wb in weights.items():
        for quantized in (False, True):
            spec = KVCacheSpec(1, 16, L, Hk, Dh, torch.bfloat16, quantized)
            rows.append({"weights": label, "kv": "int8" if quantized else "bf16",
                         "weight_bytes": wb, "kv_bytes_per_token": spec.bytes_per_token,
                         "max_seqs": fit(budget, wb, spec.bytes_per_block, 16, seq_len)})
    return rows


def fit(budget: int, weight_bytes: int, bytes_per_block: int, block_size: int, seq_len: int) -> int:
    blocks = max(0, budget - weight_bytes) // bytes_per_block
    return blocks // -(-seq_len // block_size)


def main(argv: list[str] | None = None) -> None:
    from tests.quality import compare, mean_top_probability, score
    from tinyserve.cli.values import parse_size
    from tinyserve.engine.loading.model_config import ModelLoadError
    from tinyserve.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=parse_size, default=parse_size("8MiB"),
                    help="memory for weights + KV cache")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (prompt + output)")
    ap.add_argument("--markdown", action="store_true", help="print README tables too")
    ap.add_argument("--big-budget", type=parse_size, default=parse_size("80GiB"),
                    help="the memory of the computed Llama-3-8B table")
    ap.add_argument("--big-seq-len", type=int, default=8192)
    ap.add_argument("--family", choices=sorted(FAMILY_CONFIGS),
                    help="a random-weight checkpoint of this family instead of stories260k")
    args = ap.parse_args(argv)

    model = None
    if args.family:
        import tempfile

        model = family_checkpoint(args.family, tempfile.mkdtemp(prefix=args.family))
    base = LLM(model, num_kv_blocks=256)
    seqs = texts(base, args.family)
    ref = [score(base, t) for t in seqs]
    confidence = mean_top_probability(ref)
    print(json.dumps({"fp32_mean_top_probability": round(confidence, 4)}), flush=True)
    rows = []
    for label, kw in CONFIGS:
        for kv in ("auto", "int8"):
            try:
                llm = base if (not kw and kv == "auto") else LLM(model, num_kv_blocks=256,
                                                                 kv_cache_dtype=kv, **kw)
            except ModelLoadError as e:  # (int4 experts)
                rows.append({"weights": label, "kv": kv, "refused": str(e)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            got = [score(llm, t) for t in seqs]
            # (a family has no reference text: its first sample stands in)
            on_ref, on_all = compare(ref[:1], got[:1]), compare(ref, got)
            spec = llm.engine.runner.kv_spec
            rows.append({
                "weights": label, "kv": "int8" if kv == "int8" else llm.info.dtype,
                "agreement_reference": round(on_ref.agreement, 4),
                "mean_abs_dlogprob_reference": round(on_ref.mean_abs_dlogprob, 5),
                "agreement_sampled": round(on_all.agreement, 4),
                "mean_abs_dlogprob_sampled": round(on_all.mean_abs_dlogprob, 5),
                "positions": [on_ref.positions, on_all.positions],
                "weight_bytes": llm.info.weight_bytes,
                "kv_bytes_per_token": spec.bytes_per_token,
                "max_seqs": fit(args.budget, llm.info.weight_bytes, spec.bytes_per_block,
                                spec.block_size, args.seq_len),
            })
            print(json.dumps(rows[-1]), flush=True)
    if args.markdown:
        print(f"\nfp32's mean probability of its top token over the texts: {confidence:.2f}")
        first = "first sample" if args.family else "reference text"
        print(f"\n| weights | KV | agreement, {first} | mean \\|Δlogprob\\| | agreement, "
              f"sampled | mean \\|Δlogprob\\|, sampled | weight bytes | KV bytes/token | "
              f"sequences of {args.seq_len} in {args.budget / 2**20:g} MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "refused" in r:
                print(f"| {r['weights']} | {r['kv']} | refused: {r['refused']} |")
                continue
            print(f"| {r['weights']} | {r['kv']} | {r['agreement_reference']:.1%} | "
                  f"{r['mean_abs_dlogprob_reference']:.4f} | {r['agreement_sampled']:.1%} | "
                  f"{r['mean_abs_dlogprob_sampled']:.4f} | {r['weight_bytes']:,} | "
                  f"{r['kv_bytes_per_token']} | {r['max_seqs']} |")
        if args.family:
            return
        print(f"\n| Llama-3-8B (computed) | KV | weight bytes | KV bytes/token | sequences of "
              f"{args.big_seq_len} in {args.big_budget / 2**30:g} GiB |")
        print("|---|---|---|---|---|")
        for r in llama3_8b_rows(args.big_budget, args.big_seq_len):
            print(f"| {r['weights']} | {r['kv']} | {r['weight_bytes'] / 1e9:.2f} GB | "
                  f"{r['kv_bytes_per_token']:,} | {r['max_seqs']} |")


if __name__ == "__main__":
    main()
