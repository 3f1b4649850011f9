"""Grammar memory under hostile structured output (issue 26): the server's RSS while one
client sends many distinct 30,000-value ``guided_choice`` chat requests (1.4 MB bodies, under
the 4 MiB limit), then small grammars; and a throttled tenant's time per refused request.

    python loadtest/bench_grammar_memory.py [--requests 70] [--values 30000]
        [--server-args "--grammar-cache-memory 256MiB"]

Runs ``python -m tinyserve`` (stories260k) as a subprocess and reads its VmRSS / VmHWM from
/proc. Prints one JSON line: RSS at start, peak, after the large grammars and after 20 small
ones (MB), and the throttled tenant's refusal times (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root: tests.server

from tests.server.conftest import ServerProcess  # noqa: E402

KEY, SLOW = "bench-key-1", "throttled-key-1"


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def body(values: list[str] | None, max_tokens: int = 2, **kw) -> dict:
    b = {"model": "stories260k", "messages": [{"role": "user", "content": "Pick one."}],
         "max_tokens": max_tokens, "temperature": 0, **kw}
    if values is not None:
        b["guided_choice"] = values
    return b


async def post(s: aiohttp.ClientSession, url: str, key: str, b: dict) -> int:
    async with s.post(url + "/v1/chat/completions", json=b,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


async def run(url: str, pid: int, requests: int, values: int) -> dict:
    out: dict = {"start_mb": round(rss_mb(pid)[0])}
    async with aiohttp.ClientSession() as s:
        statuses = []
        for i in range(requests):
            statuses.append(await post(s, url, KEY, body(
                [f"n{i}_{j}_" + "z" * 30 for j in range(values)])))
        out["large_statuses"] = sorted(set(statuses))
        out["after_large_mb"] = round(rss_mb(pid)[0])
        for i in range(20):
            await post(s, url, KEY, body([f"s{i}", f"t{i}"]))
        out["after_small_mb"] = round(rss_mb(pid)[0])
        # the throttled tenant: its bucket spent, each 30,000-value request must be a cheap 429
        assert await post(s, url, SLOW, body(None, max_tokens=90, ignore_eos=True)) == 200
        took, codes = [], []
        for i in range(4):
            t0 = time.perf_counter()
            codes.append(await post(s, url, SLOW, body(
                [f"q{i}_{j}_" + "z" * 30 for j in range(values)], max_tokens=60)))
            took.append((time.perf_counter() - t0) * 1000)
        out["throttled_statuses"] = codes
        out["throttled_ms"] = round(statistics.median(took), 1)
    out["peak_mb"] = round(rss_mb(pid)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=70)
    ap.add_argument("--values", type=int, default=30_000)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--max-growth-mb", type=float, default=400.0,
                    help="fail (exit 1) if RSS after the large grammars grew more than this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(f'[tenants.bench]\napi_key = "{KEY}"\n'
                           f'[tenants.slow]\napi_key = "{SLOW}"\ntokens_per_minute = 120\n')
        srv = ServerProcess("--tenants", str(tenants), *shlex.split(args.server_args),
                            log_path=Path(tmp) / "server.log")
        try:
            result = asyncio.run(run(srv.url, srv.proc.pid, args.requests, args.values))
        finally:
            srv.stop()
    print(json.dumps({"requests": args.requests, "values": args.values,
                      "server_args": args.server_args, **result}))
    if result["after_large_mb"] - result["start_mb"] > args.max_growth_mb:
        sys.exit(f"RSS grew more than {args.max_growth_mb} MB")


if __name__ == "__main__":
    main()
