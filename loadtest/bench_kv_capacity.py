"""How many sequences one --kv-cache-memory holds, fp16 KV against int8 KV, measured by running.

    python loadtest/bench_kv_capacity.py [--kv-cache-memory 2MiB] [--prompt 16] [--tokens 48]

For each KV dtype it loads the same model with the same --kv-cache-memory, then submits batches
of identical requests (prompt + exactly --tokens generated, prefix caching off) all at once,
and reports, for the largest batch that runs with no preemption, how many sequences were
decoding together at the peak. A batch one larger is run too: it must preempt (or wait), which
shows the limit is the cache, not --max-num-seqs. The model is a random-weight Llama with
head_dim 128 (Llama-3's), where an int8 token costs 130 bytes per head against fp16's 256;
stories260k's head_dim 8 pays more for its scales (10 against 16).

Prints one JSON object per KV dtype and the ratio. A benchmark: it reports, it asserts
nothing (tests/engine/test_kv_int8_engine.py holds the >= 1.9x as a behaviour at a smaller size).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (no-op on a GPU box)

HEAD_DIM_128 = {  # one KV head of Llama-3's width; small enough for the interpreter
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
    "torch_dtype": "float16",
}


def write_model(path: Path) -> Path:
    from tinyserve.engine.loading.demo import DEMO_CONFIG, write_random_llama, write_tokenizer

    write_random_llama(path, {**DEMO_CONFIG, **HEAD_DIM_128})
    write_tokenizer(path)
    return path


def run_batch(llm, n: int, prompt_len: int, tokens: int) -> dict:
    """n requests at once; the peak number decoding together and the preemptions."""
    from tinyserve.messages import SamplingParams

    core = llm.core
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = core.scheduler.num_preemptions
    ids = [core.add_request(10_000 + i, [1 + (i + j) % 200 for j in range(prompt_len)], params)
           .request_id for i in range(n)]
    peak, t0 = 0, time.perf_counter()
    try:
        while core.has_unfinished:
            plan = core.schedule()
            peak = max(peak, len(core.scheduler.running))
            core.process(plan, llm.engine.runner.execute(plan))
    finally:
        for i in ids:
            core.release(i)
    return {"requests": n, "peak_running": peak,
            "preemptions": core.scheduler.num_preemptions - before,
            "seconds": round(time.perf_counter() - t0, 2)}


def measure(model: Path, kv_cache_dtype: str, kv_memory: int, prompt_len: int, tokens: int,
            dtype: str = "float16", one_more: bool = True) -> dict:
    """The engine's capacity for this budget, then the batch that fills it (and one more)."""
    from tinyserve.llm import LLM

    llm = LLM(str(model), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_memory,
              max_num_seqs=512, max_model_len=prompt_len + tokens, enable_prefix_caching=False,
              enforce_eager=True)
    spec = llm.engine.runner.kv_spec
    per_seq = -(-(prompt_len + tokens) // spec.block_size)
    fits = spec.num_blocks // per_seq
    full = run_batch(llm, fits, prompt_len, tokens)
    over = run_batch(llm, fits + 1, prompt_len, tokens) if one_more else None
    return {"kv_cache_dtype": kv_cache_dtype, "kv_cache_memory": kv_memory,
            "bytes_per_token": spec.bytes_per_token, "num_blocks": spec.num_blocks,
            "blocks_per_seq": per_seq, "fits": fits, "at_capacity": full, "one_more": over,
            "sequences_without_preemption":
                full["peak_running"] if full["preemptions"] == 0 else None}


def main(argv: list[str] | None = None) -> None:
    from tinyserve.cli.values import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("2MiB"))
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per request")
    ap.add_argument("--model", default=None, help="model directory (default: a random "
                    "head_dim-128 Llama written to a temporary directory)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else write_model(Path(tmp))
        rows = [measure(model, d, args.kv_cache_memory, args.prompt, args.tokens)
                for d in ("auto", "int8")]
    for row in rows:
        print(json.dumps(row))
    a, b = (r["sequences_without_preemption"] for r in rows)
    if a and b:
        print(json.dumps({"int8_over_fp16_sequences": round(b / a, 3)}))


if __name__ == "__main__":
    main()
