"""Serving benchmark: N concurrent streaming clients against tinyserve, several configs in one run.

    python loadtest/bench.py --concurrency 16 \\
        --requests 32 --max-tokens 32

For each config (a set of server flags) it starts ``python -m tinyserve`` on a free port, waits
until ready, runs the load, stops the server, and reports request and token throughput, TTFT,
TPOT, ITL and end-to-end latency (p50/p95/p99) and goodput under an SLA. The default configs
compare no batching (--max-num-seqs 1) with continuous batching and print the ratio. Prompts
are fixed-length slices of a story and every request generates exactly --max-tokens tokens
(ignore_eos), so configs see the same work. Point --url at a running server to skip launching.

    python loadtest/bench.py --plot docs/bench.png --rates 1 2 4 8 --concurrencies 1 4 16 32

sweeps one server (the last config, or --url) instead: latency percentiles (TTFT, E2E) against
an open-loop Poisson request rate, and throughput and goodput against the number of closed-loop
clients, drawn as one PNG (matplotlib) and printed as JSON rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high. "
         "Lily asked her mom for help. Her mom smiled and lifted her up so she could reach it. ")


@dataclass
class Result:
    ttft: float
    e2e: float
    tokens: int
    itl: list[float] = field(default_factory=list)
    status: int = 200  # an error answer (429 under overload, 503...): counted, never good

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    itl, tokens = [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            end = time.perf_counter()
            return Result(ttft=end - t0, e2e=end - t0, tokens=0, status=r.status)
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            if msg.get("choices") and msg["choices"][0].get("text"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
    end = time.perf_counter()
    return Result(ttft=(first or end) - t0, e2e=end - t0, tokens=tokens, itl=itl)


async def run_open(url: str, model: str, rate: float, requests: int, prompt_words: int,
                   max_tokens: int, seed: int = 0) -> tuple[list[Result], float]:
    """Open loop: requests arrive as a Poisson process of ``rate`` per second, whatever the
    server's pace (closed-loop clients would slow down with it and hide queueing)."""
    import random

    rng = random.Random(seed)
    words = STORY.split()
    timeout = aiohttp.ClientTimeout(total=None)
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(i: int) -> None:
            prompt = " ".join(words[i % 20: i % 20 + prompt_words])
            results.append(await one_request(session, url, model, prompt, max_tokens))

        tasks = []
        t0 = time.perf_counter()
        due = t0
        for i in range(requests):  # on an absolute schedule: a late client does not drift
            if i:
                due += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def run_load(url: str, model: str, concurrency: int, requests: int, prompt_words: int,
                   max_tokens: int) -> tuple[list[Result], float]:
    words = STORY.split()
    prompts = [" ".join(words[i % 20: i % 20 + prompt_words]) for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=None)

    async def client() -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not queue.empty():
                results.append(await one_request(session, url, model, queue.get_nowait(),
                                                 max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tinyserve", "--port", str(port), "--log-level", "warning",
           *(["--model", model] if model else []), *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            import urllib.request

            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready")


def served_name(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def summarize(name: str, results: list[Result], wall: float, sla_ttft: float,
              sla_tpot: float) -> dict:
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    results_all, results = results, [r for r in results if r.status == 200]
    tokens = sum(r.tokens for r in results)
    good = [r for r in results if r.ttft <= sla_ttft and r.tpot <= sla_tpot]
    itl = [x for r in results for x in r.itl]
    return {
        "config": name, "requests": len(results_all), "errors": errors, "wall_s": wall,
        "req_per_s": len(results) / wall, "tok_per_s": tokens / wall,
        "goodput_req_per_s": len(good) / wall,
        "ttft_p50": pct([r.ttft for r in results], 50), "ttft_p95": pct([r.ttft for r in results], 95),
        "ttft_p99": pct([r.ttft for r in results], 99),
        "tpot_p50": pct([r.tpot for r in results], 50), "tpot_p95": pct([r.tpot for r in results], 95),
        "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95),
        "e2e_p50": pct([r.e2e for r in results], 50), "e2e_p95": pct([r.e2e for r in results], 95),
        "e2e_p99": pct([r.e2e for r in results], 99),
    }


def print_table(rows: list[dict], sla_ttft: float, sla_tpot: float) -> None:
    cols = [("config", "config", "{}"), ("req/s", "req_per_s", "{:.2f}"),
            ("tok/s", "tok_per_s", "{:.1f}"),
            (f"goodput req/s (TTFT<={sla_ttft}s, TPOT<={sla_tpot}s)", "goodput_req_per_s",
             "{:.2f}"),
            ("TTFT p50/p95/p99 s", ("ttft_p50", "ttft_p95", "ttft_p99"), "{:.2f}"),
            ("TPOT p50/p95 s", ("tpot_p50", "tpot_p95"), "{:.3f}"),
            ("ITL p50/p95 s", ("itl_p50", "itl_p95"), "{:.3f}"),
            ("E2E p50/p95/p99 s", ("e2e_p50", "e2e_p95", "e2e_p99"), "{:.2f}")]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = []
        for _, key, fmt in cols:
            keys = key if isinstance(key, tuple) else (key,)
            cells.append(" / ".join(fmt.format(row[k]) for k in keys))
        print("| " + " | ".join(cells) + " |")


def sweep(url: str, args) -> tuple[list[dict], list[dict]]:
    model = served_name(url)
    asyncio.run(run_load(url, model, 1, 1, args.prompt_words, 2))  # warm the path
    by_rate, by_conc = [], []
    for rate in args.rates:
        results, wall = asyncio.run(run_open(url, model, rate, args.requests, args.prompt_words,
                                             args.max_tokens))
        by_rate.append({"rate": rate, **summarize(f"rate {rate}/s", results, wall,
                                                  args.sla_ttft, args.sla_tpot)})
        print(json.dumps(by_rate[-1]), flush=True)
    for conc in args.concurrencies:
        results, wall = asyncio.run(run_load(url, model, conc, max(args.requests, conc),
                                             args.prompt_words, args.max_tokens))
        by_conc.append({"concurrency": conc, **summarize(f"{conc} clients", results, wall,
                                                         args.sla_ttft, args.sla_tpot)})
        print(json.dumps(by_conc[-1]), flush=True)
    return by_rate, by_conc


def plot(by_rate: list[dict], by_conc: list[dict], path: str, title: str) -> None:
    """Left: TTFT and E2E p50/p95/p99 against request rate. Right: token throughput and
    request goodput against concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [r["rate"] for r in by_rate]
    for metric, style in (("ttft", "-"), ("e2e", "--")):
        for q, marker in (("p50", "o"), ("p95", "s"), ("p99", "^")):
            left.plot(rates, [r[f"{metric}_{q}"] for r in by_rate], style, marker=marker,
                      label=f"{metric.upper()} {q}")
    left.set(xlabel="request rate (Poisson arrivals, req/s)", ylabel="seconds",
             title="latency vs request rate")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    conc = [r["concurrency"] for r in by_conc]
    right.plot(conc, [r["tok_per_s"] for r in by_conc], "-o", color="tab:blue", label="tokens/s")
    right.set(xlabel="concurrent clients (closed loop)", ylabel="output tokens/s",
              title="throughput and goodput vs concurrency")
    right.grid(alpha=0.3)
    twin = right.twinx()
    twin.plot(conc, [r["goodput_req_per_s"] for r in by_conc], "-s", color="tab:green",
              label="goodput req/s")
    twin.plot(conc, [r["req_per_s"] for r in by_conc], ":^", color="tab:gray", label="req/s")
    twin.set_ylabel("requests/s")
    lines = right.get_lines() + twin.get_lines()
    right.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled stories260k)")
    ap.add_argument("--url", default=None, help="benchmark this running server instead")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sla-ttft", type=float, default=2.0, help="goodput SLA on TTFT, seconds")
    ap.add_argument("--sla-tpot", type=float, default=0.5, help="goodput SLA on TPOT, seconds")
    ap.add_argument("--config", action="append", default=None, metavar="NAME=FLAGS",
                    help='server flags to compare, e.g. "int8=--quantization int8" (repeatable)')
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="sweep request rates and concurrencies on one server; draw them here")
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16, 32])
    args = ap.parse_args(argv)
    if args.config and any("=" not in c for c in args.config):
        ap.error("--config takes NAME=FLAGS")
    if args.plot:
        if args.config and (args.url or len(args.config) > 1):
            ap.error("--plot sweeps one server: give at most one --config, and none with --url")
        flags = (args.config[0].split("=", 1)[1] if args.config
                 else f"--max-num-seqs {max(args.concurrencies)}")
        proc, url = (None, args.url) if args.url else start_server(args.model, flags.split())
        try:
            name = served_name(url)
            by_rate, by_conc = sweep(url, args)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
        plot(by_rate, by_conc, args.plot,
             f"tinyserve, {name}: {args.requests} "
             f"requests per point, {args.prompt_words}-word prompts, {args.max_tokens} tokens "
             f"each; goodput: TTFT <= {args.sla_ttft}s and TPOT <= {args.sla_tpot}s")
        print(f"wrote {args.plot}", file=sys.stderr)
        return
    configs = [c.split("=", 1) for c in (args.config or [
        "no batching (--max-num-seqs 1)=--max-num-seqs 1",
        f"continuous batching (--max-num-seqs {args.concurrency})="
        f"--max-num-seqs {args.concurrency}"])]
    rows = []
    for name, flags in ([["running server", ""]] if args.url else configs):
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args.model, flags.split())
        try:
            model = served_name(url)
            asyncio.run(run_load(url, model, 1, 1, args.prompt_words, 2))  # warm the path
            results, wall = asyncio.run(run_load(url, model, args.concurrency, args.requests,
                                                 args.prompt_words, args.max_tokens))
            rows.append(summarize(name, results, wall, args.sla_ttft, args.sla_tpot))
            print(f"{name}: {len(results)} requests in {wall:.1f}s", file=sys.stderr)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
    print(f"\n{args.concurrency} concurrent streams, {args.requests} requests, "
          f"{args.prompt_words}-word prompts, {args.max_tokens} output tokens each\n")
    print_table(rows, args.sla_ttft, args.sla_tpot)
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(f"\n{b['config']} vs {a['config']}: {b['tok_per_s'] / a['tok_per_s']:.2f}x token "
              f"throughput, {b['req_per_s'] / a['req_per_s']:.2f}x request throughput, "
              f"TTFT p95 {b['ttft_p95']:.2f}s vs {a['ttft_p95']:.2f}s")


if __name__ == "__main__":
    main()
