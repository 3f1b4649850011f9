"""Routing benchmark: a weighted gray release, a live weight change, and fallback under
overload, on the real server in-process with stand-in models of fixed step cost.

    python loadtest/bench_routes.py [--phase-seconds 30] [--no-fallback]

Part 1 (split): models a and b, ``--route chat=a:90,b:10``; 1,000 requests from 1,000 users,
then the first 200 users again (did anyone switch version?), then, under 16 closed-loop
clients, the weights go to 80/20 through ``POST /admin/routes``: failed requests around the
change, the split after it, and which users moved.

Part 2 (fallback): model a (20 ms steps, 8 sequences: about 44 requests/s of 8 tokens) with
``--slo-ttft-ms 400 --fallback a=b`` (b: 10 ms steps, the int8 variant's role), two tenants
sending to a in equal parts, one degradable. Open-loop Poisson load at 1x, 2x, then 0.5x of
a's capacity. Per phase: who answered each tenant, P95 TTFT, 429/503s; and when the
degradable traffic moved to b and when it came back. ``--no-fallback`` runs the same load
without ``--fallback`` for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import aiohttp

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root

from loadtest.bench_slo import open_loop  # noqa: E402
from tests.server.conftest import metric_value  # noqa: E402
from tests.server.inprocess import FakeRunner, InProcessServer  # noqa: E402
from tinyserve.config import TenantConfig  # noqa: E402
from tinyserve.core.slo import p95  # noqa: E402

STEP_S, SEQS, TOKENS = 0.020, 8, 8
CAPACITY = SEQS / ((TOKENS + 1) * STEP_S)  # requests/s model a can finish
ADMIN, DEG, FIRM = "key-ops", "key-deg", "key-firm"
TENANTS = (TenantConfig("ops", ADMIN, admin=True), TenantConfig("deg", DEG, degradable=True),
           TenantConfig("firm", FIRM))


async def _one(s: aiohttp.ClientSession, url: str, model: str, key: str, user: str | None,
               max_tokens: int, stream: bool = False) -> tuple[int, str | None, float | None]:
    """-> (status, answering model, TTFT seconds when streamed)."""
    body = {"model": model, "prompt": [1, 5, 9], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **({"user": user} if user else {})}
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        ttft = None
        if stream and r.status == 200:
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["text"]:
                        ttft = time.perf_counter() - t0
        else:
            await r.read()
        return r.status, r.headers.get("X-Tinyserve-Model"), ttft


async def _split(url: str) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        sem = asyncio.Semaphore(32)

        async def one(user: str) -> tuple[int, str | None]:
            async with sem:
                status, model, _ = await _one(s, url, "chat", FIRM, user, 1)
                return status, model

        users = [f"user-{i}" for i in range(1000)]
        first = await asyncio.gather(*(one(u) for u in users))
        again = await asyncio.gather(*(one(u) for u in users[:200]))
        switched = sum(a != b for a, b in zip(first, again, strict=False))

        stop, seen = asyncio.Event(), []

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                user = users[(i * 61 + n) % 1000]
                status, model, _ = await _one(s, url, "chat", FIRM, user, 4, stream=n % 2 == 0)
                seen.append((time.perf_counter(), user, status, model))
                n += 1

        clients = [asyncio.ensure_future(client(i)) for i in range(16)]
        await asyncio.sleep(2.0)
        async with s.post(url + "/admin/routes", headers={"Authorization": f"Bearer {ADMIN}"},
                          json={"alias": "chat", "weights": {"a": 80, "b": 20}}) as r:
            assert r.status == 200, await r.text()
        changed = time.perf_counter()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*clients)
        after = [(u, m) for t, u, st, m in seen if t > changed + 0.05 and st == 200]
        before = dict(zip(users, (m for _, m in first), strict=True))
        moved = collections.Counter((before[u], m) for u, m in set(after) if before[u] != m)
        return {
            "share_a": sum(m == "a" for _, m in first) / len(first),
            "errors_first": sum(st != 200 for st, _ in first),
            "switched_on_repeat": switched,
            "requests_around_change": len(seen),
            "failed_around_change": sum(st != 200 for _, _, st, _ in seen),
            "share_a_after": sum(m == "a" for _, m in after) / max(1, len(after)),
            "users_after": len({u for u, _ in after}),
            "moved": {f"{a}->{b}": n for (a, b), n in moved.items()},
        }


async def _overload(url: str, phases: list[tuple[float, float]], seed: int) -> list[tuple]:
    """Poisson arrivals to model a, tenants alternating -> (sent, key, status, model, TTFT)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(300)) as s:
        async def one(i: int, sent: float) -> tuple:
            key = DEG if i % 2 else FIRM
            status, model, ttft = await _one(s, url, "a", key, None, TOKENS, stream=True)
            return sent, key, status, model, ttft

        return await open_loop(phases, seed, one)


def run(phase_seconds: float = 30.0, fallback: bool = True, seed: int = 1) -> dict:
    report: dict = {}
    srv = InProcessServer(models={"a": FakeRunner(), "b": FakeRunner()}, tenants=TENANTS,
                          routes=(("chat", (("a", 90.0), ("b", 10.0))),), max_num_seqs=16,
                          max_waiting=64)
    try:
        report["split"] = asyncio.run(_split(srv.url))
    finally:
        srv.stop()

    srv = InProcessServer(models={"a": FakeRunner(step_seconds=STEP_S),
                                  "b": FakeRunner(step_seconds=STEP_S / 2)},
                          tenants=TENANTS, fallbacks=(("a", "b"),) if fallback else (),
                          slo_ttft_ms=400, max_num_seqs=SEQS, max_waiting=64)
    lane = srv.server.admission.lanes["a"]
    levels = [(0.0, 0)]
    set_level = lane.slo._set_level
    t0 = time.perf_counter()

    def noting(level, why):  # when a's degradation level moved (seconds into part 2)
        set_level(level, why)
        if lane.slo.level != levels[-1][1]:
            levels.append((round(time.perf_counter() - t0, 1), lane.slo.level))

    lane.slo._set_level = noting
    phases = [(phase_seconds, 1.0 * CAPACITY), (phase_seconds, 2.0 * CAPACITY),
              (phase_seconds * 1.5, 0.5 * CAPACITY)]
    try:
        t0 = time.perf_counter()
        results = asyncio.run(_overload(srv.url, phases, seed))
        text = asyncio.run(_scrape(srv.url))
    finally:
        srv.stop()
    bounds, start = [], 0.0
    for seconds, rate in phases:
        bounds.append((start, start + seconds, rate / CAPACITY))
        start += seconds
    per_phase = []
    for lo, hi, load in bounds:
        row: dict = {"load": load}
        for key, name in ((FIRM, "firm"), (DEG, "deg")):
            mine = [r for r in results if r[1] == key and lo <= r[0] < hi]
            ok = [r for r in mine if r[2] == 200]
            row[name] = {
                "sent": len(mine), "ok": len(ok),
                "by_a": sum(r[3] == "a" for r in ok), "by_b": sum(r[3] == "b" for r in ok),
                "429": sum(r[2] == 429 for r in mine), "503": sum(r[2] == 503 for r in mine),
                "other_errors": sum(r[2] not in (200, 429, 503) for r in mine),
                "ttft_p95_ms": round(1000 * (p95([r[4] for r in ok if r[4] is not None])
                                             or 0)),
                "within_400ms": sum(r[4] is not None and r[4] <= 0.4 for r in ok)}
        per_phase.append(row)
    to_b = [r[0] for r in results if r[1] == DEG and r[3] == "b"]
    report["fallback"] = {
        "phases": per_phase, "levels": levels,
        "first_to_b_s": round(min(to_b), 1) if to_b else None,
        "last_to_b_s": round(max(to_b), 1) if to_b else None,
        "firm_ever_on_b": sum(r[1] == FIRM and r[3] == "b" for r in results),
        "fallback_metric": metric_value(text, "tinyserve:fallback_requests_total"),
        "lost": sum(r[2] == 200 and r[4] is None for r in results)}
    return report


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-seconds", type=float, default=30.0)
    ap.add_argument("--no-fallback", action="store_true")
    args = ap.parse_args()
    print(json.dumps(run(args.phase_seconds, not args.no_fallback), indent=1))


if __name__ == "__main__":
    main()
