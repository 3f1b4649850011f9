"""Per-step serving overhead: how close the real server gets to its model's step rate.

    python loadtest/bench_overhead.py [--streams 16 64 256] [--tokens 200] [--step-ms 10]
                                      [--no-overlap] [--stream-interval 1 ...]
                                      [--stream-write-rate R ...] [--repeat 3]

The real server in-process on a stand-in model whose step takes a fixed time (it sleeps), and
N streaming HTTP clients in another process (so their parsing does not share our event loop),
all started together, each asking for ``--tokens`` tokens (ignore_eos). The ideal wall time
is one step per token: every stream's tokens come out of the same steps. Efficiency = ideal /
measured wall time (first request sent to the last stream's [DONE]); the per-step overhead is
(measured - ideal) / tokens. The server's CPU time (this process: event loop and step thread;
user + system, and the system part alone: the socket writes) over the N streams' run (not the
warm-up request) and the clients' (their process) are reported per streamed token; a client
CPU share near 1.0 means the one client process, not the server, set the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root


def _clients(url: str, streams: int, tokens: int, out: mp.Queue) -> None:
    """In its own process: ``streams`` concurrent streaming completions -> (wall s, tokens)."""
    import aiohttp

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        body = {"model": "stories260k", "prompt": [1, 3 + i % 300], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        # SSE events counted in whatever the socket delivers (not line by line: the client
        # shares this VM's two vCPUs with the server, and its own CPU slows the server's)
        n, tail = 0, b""
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for chunk in r.content.iter_any():
                buf = tail + chunk
                n += buf.count(b"data: {")
                tail = buf[-(len(b"data: {") - 1):]  # (too short to hold one: none twice)
        return n

    async def main() -> tuple[float, int, float]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn,
                                         timeout=aiohttp.ClientTimeout(600)) as s:
            await one(s, 0)  # warm the connection path
            out.put("warm")  # (the server's CPU is counted from here)
            t0, c0 = time.perf_counter(), time.process_time()
            counts = await asyncio.gather(*(one(s, i) for i in range(streams)))
            return time.perf_counter() - t0, sum(counts), time.process_time() - c0

    out.put(asyncio.run(main()))


def run(streams: int, tokens: int = 200, step_ms: float = 10.0, overlap: bool = True,
        stream_interval: int = 1, write_rate: float | None = None) -> dict:
    from tests.server.inprocess import FakeRunner, InProcessServer

    srv = InProcessServer(FakeRunner(step_seconds=step_ms / 1000), max_model_len=tokens + 16,
                          num_kv_blocks=streams * (-(-(tokens + 16) // 16)) + 16,
                          max_num_seqs=max(streams, 1), max_num_batched_tokens=max(2048, 4 * streams),
                          max_waiting=streams + 8, overlap=overlap, freeze_heap=True,
                          stream_interval=stream_interval,
                          **({} if write_rate is None else {"stream_write_rate": write_rate}),
                          use_uvloop=True)  # as python -m tinyserve runs
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_clients, args=(srv.url, streams, tokens, out))
        proc.start()
        # the server's CPU: this process's (the event loop, the step thread, whose stand-in
        # step sleeps), user and system, read around the N streams' run alone
        assert out.get(timeout=300) == "warm"
        steps0, cpu0 = srv.runner.steps, resource.getrusage(resource.RUSAGE_SELF)
        wall, chunks, client_cpu = out.get(timeout=900)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        steps = srv.runner.steps - steps0
        proc.join(30)
    finally:
        srv.stop()
    ideal = tokens * step_ms / 1000
    user, system = cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime
    server_cpu = user + system
    return {"streams": streams, "tokens": tokens, "step_ms": step_ms, "overlap": overlap,
            "stream_interval": stream_interval, "write_rate": srv.server.cfg.stream_write_rate,
            "wall_s": round(wall, 3), "ideal_s": round(ideal, 3),
            "efficiency": round(ideal / wall, 3),
            "overhead_ms_per_step": round((wall - ideal) / tokens * 1000, 2),
            # per generated token (streams x tokens; a chunk holds stream_interval of them)
            "server_cpu_us_per_token": round(server_cpu / (streams * tokens) * 1e6, 1),
            "server_sys_us_per_token": round(system / (streams * tokens) * 1e6, 1),
            "client_cpu_us_per_token": round(client_cpu / (streams * tokens) * 1e6, 1),
            "client_cpu_share": round(client_cpu / wall, 2),  # ~1.0: the clients set the pace
            "steps": steps, "sse_chunks": chunks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--stream-interval", type=int, nargs="+", default=[1])
    ap.add_argument("--stream-write-rate", type=float, nargs="+", default=[None],
                    help="the server's --stream-write-rate (default: its default)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each configuration, taken in turn (this VM's neighbours "
                         "move single runs by a third); then each one's medians")
    args = ap.parse_args()
    configs = [(rate, interval, n) for rate in args.stream_write_rate
               for interval in args.stream_interval for n in args.streams]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for rate, interval, n in configs:
            r = run(n, args.tokens, args.step_ms, not args.no_overlap, interval, rate)
            runs[(rate, interval, n)].append(r)
            print(json.dumps(r), flush=True)
    if args.repeat > 1:
        for c, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in (
                "efficiency", "server_cpu_us_per_token", "server_sys_us_per_token",
                "client_cpu_us_per_token", "client_cpu_share")}
            print(json.dumps({"median_of": len(rs), "streams": c[2], "stream_interval": c[1],
                              "write_rate": rs[0]["write_rate"], **med}), flush=True)


if __name__ == "__main__":
    main()
