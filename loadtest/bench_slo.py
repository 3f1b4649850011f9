"""SLO control benchmark: load stepped up to 2x capacity, with and without ``--slo-ttft-ms``.

    python loadtest/bench_slo.py [--phase-seconds 15] [--slo-ttft-ms 400]

The real server in-process on a stand-in model of fixed step cost (20 ms), 8 sequences per
step, 8 tokens per request: capacity is about 8 / (9 x 20 ms) = 44 requests/s. Open-loop
Poisson load at 1x, 1.5x and 2x of that, one phase each. Reports, per configuration, goodput
(requests answered 200 with TTFT within the target, per second) and, over 1 s windows of the
2x phase after its first 6 s (convergence), the share of windows whose P95 TTFT meets the
target. Without SLO control the queue fills (up to --max-waiting) and TTFT grows with it;
with it the server holds only what it can serve in time and turns the rest away with 429.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root

from loadtest.bench_tenants import stream_one  # noqa: E402
from tests.server.inprocess import FakeRunner, InProcessServer  # noqa: E402
from tinyserve.core.slo import p95  # noqa: E402

STEP_S, SEQS, TOKENS = 0.020, 8, 8
CAPACITY = SEQS / ((TOKENS + 1) * STEP_S)  # requests/s the stand-in model can finish
WINDOW_S = 1.0


async def open_loop(phases: list[tuple[float, float]], seed: int,
                    one: Callable[[int, float], Awaitable[Any]]) -> list[Any]:
    """Poisson arrivals, rate by phase: ``one(i, seconds since the start)`` for each arrival,
    not waiting for earlier ones (open loop); all awaited at the end."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    jobs, i, start = [], 0, 0.0
    for seconds, rate in phases:
        start += seconds
        while time.perf_counter() - t0 < start:
            jobs.append(asyncio.ensure_future(one(i, time.perf_counter() - t0)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*jobs)


async def _load(url: str, phases: list[tuple[float, float]], seed: int
                ) -> list[tuple[float, int, float | None]]:
    """-> (arrival time, status, TTFT) per request."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(300)) as s:
        async def one(i: int, sent: float) -> tuple[float, int, float | None]:
            status, ttft, _ = await stream_one(s, url, "unused", i, TOKENS)
            return sent, status, ttft

        return await open_loop(phases, seed, one)


def run(phase_seconds: float = 15.0, slo_ttft_ms: float | None = 400.0, seed: int = 1,
        converge_s: float = 6.0, last_phase_seconds: float | None = None,
        overlap: bool = True) -> dict:
    """``last_phase_seconds``: a longer 2x phase (more judged windows) than the others."""
    last = last_phase_seconds or phase_seconds
    phases = [(phase_seconds, CAPACITY), (phase_seconds, 1.5 * CAPACITY), (last, 2 * CAPACITY)]
    cfg = {"slo_ttft_ms": slo_ttft_ms} if slo_ttft_ms else {}
    # The heap frozen as the real server freezes it: a full collection in this process (its
    # load generator included) stalls the loop for a window's worth of TTFT otherwise.
    srv = InProcessServer(FakeRunner(step_seconds=STEP_S), max_num_seqs=SEQS, max_waiting=256,
                          overlap=overlap, freeze_heap=True, **cfg)
    try:
        results = asyncio.run(_load(srv.url, phases, seed))
        idle = srv.wait_idle(60)
    finally:
        srv.stop()
    target = (slo_ttft_ms or 400.0) / 1000
    total = sum(s for s, _ in phases)
    good = [r for r in results if r[1] == 200 and r[2] is not None and r[2] <= target]
    last_start = total - last + converge_s  # the 2x phase, after convergence
    windows, window_p95 = [], []
    t = last_start
    while t + WINDOW_S <= total:
        ttfts = [ttft for sent, status, ttft in results
                 if t <= sent < t + WINDOW_S and status == 200 and ttft is not None]
        if ttfts:
            windows.append(p95(ttfts) <= target)
            window_p95.append(round(p95(ttfts) * 1e3))
        t += WINDOW_S
    return {
        "requests": len(results),
        "status": {code: sum(r[1] == code for r in results) for code in sorted({r[1] for r in results})},
        "goodput_per_s": len(good) / total,
        "goodput_2x_per_s": sum(1 for r in good if r[0] >= total - last) / last,
        "windows_meeting_target": (sum(windows), len(windows)),
        "window_p95_ms": window_p95,  # which windows missed, when one does
        "lost": sum(r[1] not in (200, 429, 503) for r in results),
        "idle_after": idle,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-seconds", type=float, default=15.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=400.0)
    args = ap.parse_args()
    print(f"stand-in capacity ~{CAPACITY:.0f} requests/s; phases 1x, 1.5x, 2x of it, "
          f"{args.phase_seconds:g} s each; TTFT target {args.slo_ttft_ms:g} ms")
    for label, slo in (("without --slo-ttft-ms", None), ("with --slo-ttft-ms", args.slo_ttft_ms)):
        r = run(args.phase_seconds, slo)
        met, n = r["windows_meeting_target"]
        print(f"{label:22s} goodput {r['goodput_per_s']:5.1f}/s overall, "
              f"{r['goodput_2x_per_s']:5.1f}/s at 2x; 2x windows meeting the target {met}/{n}; "
              f"statuses {r['status']}; lost {r['lost']}")


if __name__ == "__main__":
    main()
