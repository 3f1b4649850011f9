"""(f) The server end to end: ``python -m tinyserve --model DIR`` on a random Llama-3-8B-shaped
checkpoint (bf16 safetensors shards + config.json) with a 128,256-token byte-level BPE
tokenizer, both written here; 64 closed-loop streaming clients (loadtest/bench.py's, aiohttp)
send completions with exactly max_tokens tokens each (ignore_eos): TTFT / ITL / TPOT / E2E
percentiles and tokens per second. Then one prompt alone and the same prompt among 15 others
must give the same text (batch invariance through the whole server).

``prepare`` (run first, in the background: check.py's ServerPrep) writes the checkpoint; the
orchestrator starts the server on it and waits for /ready (load, warm-up: every kernel
specialization compiled and every decode bucket captured, one request through the server).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import checklib as L


def prepare(piece: L.Piece, P: dict, ctx) -> None:
    from tinyserve.engine.device import select_device

    dev = select_device(ctx.device)
    model_dir = ctx.work / "server-model"
    info = L.write_checkpoint(model_dir, P["model"], P["dtype"], dev, seed=2)
    piece.info(model_dir=str(model_dir), **info)


async def _complete(url: str, model: str, prompt: str, n: int) -> str:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        return data["choices"][0]["text"]


async def _invariance(url: str, model: str, prompts: list[str], n: int) -> tuple[str, str]:
    alone = await _complete(url, model, prompts[0], n)
    batch = await asyncio.gather(*(_complete(url, model, p, n) for p in prompts))
    return alone, batch[0]


def run(piece: L.Piece, P: dict, ctx) -> None:
    import bench  # loadtest/bench.py

    st = ctx.server
    url = st["url"]
    piece.info(checkpoint=st.get("checkpoint"), start_to_ready_s=st.get("start_to_ready_s"),
               command=st.get("command"))
    name = bench.served_name(url)
    t0 = time.perf_counter()
    results, wall = asyncio.run(bench.run_load(url, name, P["clients"], P["requests"],
                                               P["prompt_words"], P["max_tokens"]))
    s = bench.summarize("tinyserve", results, wall, math.inf, math.inf)
    ok = [r for r in results if r.status == 200]
    itl = [x for r in ok for x in r.itl]
    t = piece.table(f"{P['clients']} streaming clients, {P['requests']} requests of "
                    f"{P['max_tokens']} tokens", [
                        "requests", "errors", "tokens/s", "requests/s", "TTFT p50 ms",
                        "TTFT p95 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p95 ms", "ITL p99 ms",
                        "TPOT p50 ms", "E2E p50 s", "E2E p99 s", "wall s"])
    ms = 1e3
    piece.row(t, [s["requests"], s["errors"] or 0, round(s["tok_per_s"], 1),
                  round(s["req_per_s"], 2), round(s["ttft_p50"] * ms, 1),
                  round(s["ttft_p95"] * ms, 1), round(s["ttft_p99"] * ms, 1),
                  round(s["itl_p50"] * ms, 2), round(s["itl_p95"] * ms, 2),
                  round(bench.pct(itl, 99) * ms, 2), round(s["tpot_p50"] * ms, 2),
                  round(s["e2e_p50"], 2), round(s["e2e_p99"], 2), round(wall, 1)])
    piece.check("every request answered 200", not s["errors"], value=s["errors"] or "none")
    want = P["requests"] * P["max_tokens"]
    got = sum(r.tokens for r in ok)
    piece.check("every request produced max_tokens tokens (usage)", got == want,
                value=got, limit=want)
    words = bench.STORY.split()
    prompts = [" ".join(words[i: i + 12]) for i in range(16)]
    alone, batched = asyncio.run(_invariance(url, name, prompts, min(16, P["max_tokens"])))
    piece.check("a prompt alone == the same prompt among 15 others (greedy text)",
                alone == batched, value=json.dumps(alone[:40]))
    piece.info(load_s=round(time.perf_counter() - t0, 1))
