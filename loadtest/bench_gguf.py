"""Each GGUF type as tinyserve holds it: which kernel, how many bytes a weight, and how close the
kept form's logprobs come to the dequantized model's (the same file loaded with --dequantize).

    python loadtest/bench_gguf.py [--markdown]         # from the repository root; ~1 minute

A random-weight Llama (hidden 256, 4 layers, FFN 512: every row whole 256-blocks) is written in
each type by tests/gguf_writer.py (gguf-py's quantizers; Q4_K and Q6_K by its packers; Q5_K as
random blocks), then scored teacher-forced over a text its fp32 model sampled: top-token
agreement and max |delta logprob| between the two loads of the file, over the full vocabulary.
A benchmark: it prints, it asserts nothing (tests/engine/test_gguf_models.py holds the bounds).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/ (the GGUF writer)

KERNEL = {"Int4Linear": "int4 group-wise (int4_matmul)", "Int8GroupLinear":
          "int8 group-wise (int8_group_matmul)", "Linear": "float (matmul)"}


def main(argv: list[str] | None = None) -> None:
    import numpy as np
    import torch

    from tests import gguf_writer
    from tests.engine.test_families import build, prompt
    from tests.engine.test_model_vs_transformers import run_chunk
    from tinyserve.llm import LLM
    from tinyserve.messages import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    Q = gguf_writer.Q
    from tests.engine import test_families as fam

    fam.CONFIGS["bench"] = ("LlamaForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_hidden_layers=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    tmp = Path(tempfile.mkdtemp(prefix="bench_gguf"))
    hf = build("bench", tmp)
    n_weights = sum(p.numel() for n, p in hf.named_parameters() if "layers" in n and "norm" not in n)
    fp32 = LLM(str(tmp), dtype="float32", num_kv_blocks=32)
    [sample] = fp32.generate([prompt(3, 8)], SamplingParams(max_tokens=120, temperature=0.8,
                                                            seed=1, ignore_eos=True))
    ids = list(sample.prompt_token_ids) + list(sample.token_ids)
    blocks = list(range(1, -(-len(ids) // 16) + 1))

    def q5_k(w: np.ndarray) -> np.ndarray:  # random blocks, small scales (no packer here)
        g = np.random.default_rng(w.shape[0])
        raw = g.integers(0, 256, (w.shape[0], w.shape[1] // 256, 176), dtype=np.uint8)
        for at in (0, 2):
            raw[..., at:at + 2] = (np.full(raw.shape[:2], 0.002)).astype(np.float16).view(
                np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(w.shape[0], -1)

    rows = []
    for name in ("F16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0"):
        qtype = getattr(Q, name)
        orig = gguf_writer.encode
        if name == "Q5_K":
            gguf_writer.encode = lambda w, t: (q5_k(w), Q.Q5_K)
        try:
            path = gguf_writer.write_model(hf, tmp, tmp / f"m-{name}.gguf", qtype,
                                           types={"token_embd.weight": Q.F32,
                                                  "output.weight": Q.F32})
        finally:
            gguf_writer.encode = orig
        scores = {}
        for dequantize in (False, True):
            llm = LLM(str(path), dtype="float32", num_kv_blocks=32, dequantize=dequantize)
            lp = run_chunk(llm.engine, 0, ids, 0, blocks).double().log_softmax(-1)
            scores[dequantize] = lp
            if not dequantize:
                layer = llm.engine.runner.model.w.layers[0]
                kind = type(layer.down).__name__
                held = sum(x.nbytes - (x.bias.numel() * x.bias.element_size()
                                       if x.bias is not None else 0)
                           for layer in llm.engine.runner.model.w.layers
                           for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
        err = (scores[False] - scores[True]).abs().max().item()
        agree = (scores[False].argmax(-1) == scores[True].argmax(-1)).double().mean().item()
        block, size = gguf_writer.gguf.GGML_QUANT_SIZES[qtype]
        rows.append(dict(type=name, kernel=KERNEL[kind], held=held / n_weights,
                         file=size / block, agreement=agree, max_dlogprob=err,
                         positions=len(ids) - 1))
        print(rows[-1], flush=True)
    if args.markdown:
        print("\n| GGUF type | held as (kernel) | bytes / weight held | in the file | top token "
              "vs dequantized | max \\|Δlogprob\\| vs dequantized |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['type']} | {r['kernel']} | {r['held']:.3f} | {r['file']:.3f} | "
                  f"{r['agreement']:.1%} | {r['max_dlogprob']:.1e} |")
        print(f"\n({rows[0]['positions']} positions, full vocabulary; torch {torch.__version__})")


if __name__ == "__main__":
    main()
