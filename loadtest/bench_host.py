"""Host time of one decode step at Llama-3-8B (or Qwen3-30B-A3B) shapes, with every kernel
launch stubbed out.

    python loadtest/bench_host.py [--batch 1 64] [--context 4096] [--steps 20] [--enforce-eager]
                                  [--loras 0 8] [--model llama3-8b | qwen3-30b-a3b]

It measures our Python - packing the plan into tensors, the launchers' grid math, checks and
output allocations for 32 layers, sampling's bookkeeping - not Triton's launch path and not
the kernels: ``JITFunction.run`` (and the interpreter's) returns at once. The weights are
uninitialised CPU tensors of the real shapes (never touched, so they cost address space, not
memory); the KV cache is a few blocks that every block table points into (never read). On
the CPU the launchers take their interpreter configurations, which may differ a little from
the GPU's in what they compute per launch.

Steady-state decode: the first step sends every sequence's blocks, later ones none (as the
scheduler does between block boundaries). By default a step takes the decode-bucket path
(padded statics, replay of the recorded launches: what a CUDA graph captures on a GPU);
``--enforce-eager`` runs every launcher instead. ``--loras N``: an engine with N LoRA slots
of rank 16 (zeros: never read), the step's rows spread over the N adapters (row i on slot
i % N; 0: no LoRA at all). ``--model qwen3-30b-a3b``: 48 layers of q/k-normed attention
(32 / 4 heads of 128) and a sparse feed-forward (128 experts of 768, top 8: routing with the
expert counters, the sort, two grouped GEMMs, the combine); one set of expert tensors serves
every layer (never read, so the address space stays one layer's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192,
                 tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,),
                 torch_dtype="bfloat16")
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                     num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960,
                     tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(151645,),
                     torch_dtype="bfloat16", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                     num_experts=128, experts_per_token=8, moe_intermediate_size=768,
                     moe_renormalize=True)
MODELS = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def _stub_launches() -> int:
    """Make every Triton kernel launch return at once; returns a launch counter's index."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    counter = [0]

    def run(self, *args, **kwargs):
        counter[0] += 1

    jit.JITFunction.run = run
    interp.InterpretedFunction.run = run
    return counter


def _runner(max_len: int, enforce_eager: bool, loras: int = 0, model: str = "llama3-8b"):
    import torch

    from tinyserve.engine.loading.model_config import ModelConfig
    from tinyserve.engine.model.decoder import DecoderModel
    from tinyserve.engine.model.kv_cache import KVCacheSpec
    from tinyserve.engine.model.rope import rope_tables
    from tinyserve.engine.model.weights import ExpertWeights, LayerWeights, Linear, ModelWeights
    from tinyserve.engine.running.runner import ModelRunner

    cfg = ModelConfig(**MODELS[model])
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dt = torch.float16

    def empty(*shape):
        return torch.empty(*shape, dtype=dt)

    if cfg.num_experts:
        E, F, Dh = cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim
        experts = ExpertWeights(Linear(empty(E, D)), empty(E, 2 * F, D), empty(E, D, F))
        layers = [LayerWeights(empty(D), Linear(empty(q + 2 * kv, D)), Linear(empty(D, q)),
                               empty(D), None, None, q_norm=empty(Dh), k_norm=empty(Dh),
                               experts=experts) for _ in range(cfg.num_layers)]
    else:
        layers = [LayerWeights(empty(D), Linear(empty(q + 2 * kv, D)), Linear(empty(D, q)),
                               empty(D), Linear(empty(2 * I, D)), Linear(empty(D, I)))
                  for _ in range(cfg.num_layers)]
    weights = ModelWeights(empty(V, D), layers, empty(D), Linear(empty(V, D)))
    spec = KVCacheSpec(8, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dt)
    lora = None
    if loras:
        from tinyserve.core.adapters import ModelDims
        from tinyserve.engine.model.lora import LoraStacks

        lora = LoraStacks(ModelDims(cfg.num_layers, D, q, kv, I), loras, 16, dt, "cpu")
    model = DecoderModel(cfg, weights, rope_tables(cfg, max_len, "cpu"), lora=lora,
                         count_experts=True)
    return ModelRunner(model, cfg, spec, "cpu", max_num_seqs=64, max_model_len=max_len,
                       enforce_eager=enforce_eager)


def run(batches=(1, 64), context: int = 4096, steps: int = 20,
        enforce_eager: bool = False, loras: int = 0, model: str = "llama3-8b") -> list[dict]:
    from tinyserve.messages import SamplingParams, ScheduledSeq, StepPlan

    counter = _stub_launches()
    runner = _runner(context + 16, enforce_eager, loras, model)
    blocks = tuple(i % 8 for i in range(-(-(context + 1) // 16)))  # block ids within the pool
    rows = []
    for batch in batches:
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        ids = range(batch * 1000, batch * 1000 + batch)
        slot = (lambda i: i % loras) if loras else (lambda i: -1)
        first = tuple(ScheduledSeq(i, (1000 + i,), context, blocks, True, greedy, i,
                                   lora_slot=slot(i)) for i in ids)
        runner.execute(StepPlan(0, first))  # first call: imports, caches; all blocks sent
        seqs = tuple(ScheduledSeq(i, (1000 + i,), context, (), True, greedy, i,
                                  first_block=len(blocks), lora_slot=slot(i)) for i in ids)
        times = []
        launches0 = counter[0]
        for step in range(steps):
            t0 = time.perf_counter()
            runner.execute(StepPlan(step + 1, seqs))
            times.append(time.perf_counter() - t0)
        runner.execute(StepPlan(steps + 1, (), freed=tuple(ids)))
        rows.append({"model": model, "batch": batch, "context": context,
                     "layers": runner.cfg.num_layers, "loras": loras,
                     "path": "eager" if enforce_eager else "decode bucket",
                     "host_ms_median": round(1000 * statistics.median(times), 2),
                     "host_ms_min": round(1000 * min(times), 2),
                     "launches_per_step": (counter[0] - launches0) // steps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--loras", type=int, nargs="+", default=[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    args = ap.parse_args()
    for loras in args.loras:
        for row in run(args.batch, args.context, args.steps, args.enforce_eager, loras,
                       args.model):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
