"""Tenant isolation benchmark: a quiet tenant's TTFT, alone and next to a tenant flooding at
10x its rate, on the real server in-process with a stand-in model of fixed step cost.

    python loadtest/bench_tenants.py [--seconds 20] [--rate 2] [--step-ms 100]

The flooder has a concurrency limit (``max_concurrent``) below ``max_num_seqs``; the scheduler
shares a priority's slots by served tokens. Reports the quiet tenant's TTFT p50/p95 in both
phases, the flooder's 200s and 429s, and requests lost (answered neither 200 nor 429: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root: tests.server

from tests.server.inprocess import FakeRunner, InProcessServer  # noqa: E402
from tinyserve.config import TenantConfig  # noqa: E402

QUIET, FLOOD = "quiet-key-1", "flood-key-1"


async def stream_one(s: aiohttp.ClientSession, url: str, key: str, i: int, max_tokens: int
               ) -> tuple[int, float | None, int]:
    """-> (status, TTFT seconds, completion tokens) of one streamed completion."""
    body = {"model": "stories260k", "prompt": [1, 3 + i % 300], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            await r.read()
            return r.status, None, 0
        ttft, tokens = None, 0
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return r.status, ttft, tokens


async def _tenant(url: str, key: str, rate: float, seconds: float, max_tokens: int, seed: int
                  ) -> list[tuple[int, float | None, int]]:
    """Poisson arrivals at ``rate``/s for ``seconds``; every request awaited to its end."""
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(120)) as s:
        jobs, t_end, i = [], time.perf_counter() + seconds, 0
        while time.perf_counter() < t_end:
            jobs.append(asyncio.ensure_future(stream_one(s, url, key, i, max_tokens)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*jobs)


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(seconds: float = 20.0, rate: float = 2.0, step_ms: float = 100.0,
        max_tokens: int = 8, flood_max_concurrent: int | None = 4) -> dict:
    tenants = (TenantConfig("quiet", QUIET),
               TenantConfig("flood", FLOOD, max_concurrent=flood_max_concurrent))
    srv = InProcessServer(FakeRunner(step_seconds=step_ms / 1000), tenants=tenants,
                          max_num_seqs=8, max_waiting=64)
    try:
        alone = asyncio.run(_tenant(srv.url, QUIET, rate, seconds, max_tokens, 1))

        async def both():
            return await asyncio.gather(_tenant(srv.url, QUIET, rate, seconds, max_tokens, 2),
                                        _tenant(srv.url, FLOOD, 10 * rate, seconds, max_tokens, 3))

        quiet, flood = asyncio.run(both())
        idle = srv.wait_idle()
    finally:
        srv.stop()

    def ttfts(results):
        return [t for status, t, _ in results if status == 200]

    everything = alone + quiet + flood
    return {
        "quiet_alone_ttft_p50": statistics.median(ttfts(alone)),
        "quiet_alone_ttft_p95": _p(ttfts(alone), 0.95),
        "quiet_loaded_ttft_p50": statistics.median(ttfts(quiet)),
        "quiet_loaded_ttft_p95": _p(ttfts(quiet), 0.95),
        "quiet_requests": (len(alone), len(quiet)),
        "quiet_not_200": sum(status != 200 for status, _, _ in alone + quiet),
        "flood_200": sum(status == 200 for status, _, _ in flood),
        "flood_429": sum(status == 429 for status, _, _ in flood),
        "lost": sum(not ((status == 200 and n == max_tokens) or status == 429)
                    for status, _, n in everything),
        "idle_after": idle,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--rate", type=float, default=2.0, help="quiet tenant's requests/s")
    ap.add_argument("--step-ms", type=float, default=100.0, help="stand-in model's step cost")
    ap.add_argument("--flood-max-concurrent", type=int, default=4,
                    help="the flooder's concurrency limit (0: none, to see what it prevents)")
    args = ap.parse_args()
    r = run(args.seconds, args.rate, args.step_ms,
            flood_max_concurrent=args.flood_max_concurrent or None)
    print(f"quiet tenant TTFT alone:     p50 {r['quiet_alone_ttft_p50'] * 1e3:6.0f} ms  "
          f"p95 {r['quiet_alone_ttft_p95'] * 1e3:6.0f} ms  ({r['quiet_requests'][0]} requests)")
    print(f"quiet tenant TTFT + flooder: p50 {r['quiet_loaded_ttft_p50'] * 1e3:6.0f} ms  "
          f"p95 {r['quiet_loaded_ttft_p95'] * 1e3:6.0f} ms  ({r['quiet_requests'][1]} requests)"
          f"  ratio p95 {r['quiet_loaded_ttft_p95'] / r['quiet_alone_ttft_p95']:.2f}")
    print(f"flooder (10x rate, max_concurrent {args.flood_max_concurrent or 'none'}): "
          f"{r['flood_200']} x 200, "
          f"{r['flood_429']} x 429; quiet non-200: {r['quiet_not_200']}; lost: {r['lost']}")


if __name__ == "__main__":
    main()
