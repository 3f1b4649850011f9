"""Acceptance for the fleet: 2 replicas of stories260k under Ray Serve on this machine.

- 32 streaming requests over 4 shared prefixes return the single server's text, each prefix
  stays on one replica, and the fleet's prefix-cache hit rate is at least 90% of one server's;
- killing one replica's server mid-load: requests that had not started are retried elsewhere
  and succeed, started streams end with a clean error event, new requests succeed, and Serve
  brings the fleet back to 2 healthy replicas.
"""

# ruff: noqa: E402 (imports below the skip: without the ray extra, collecting is skipping)
import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.ray  # a step of its own in .ci/run

import asyncio
import signal
import time
from collections import defaultdict

import aiohttp
import psutil

from tests.fleet.cluster import (
    deploy,
    replica_pids,
    running_replicas,
    serve_events,
    wait_for,
)
from tests.fleet.sse import Answer, stream_completion
from tinyserve.fleet.app import FleetConfig
from tinyserve.fleet.replica import ServerProcess

PREFIXES = [
    "Once upon a time there was a little dog named Max who loved to run in the park with "
    "his friend.",
    "Lily and her mom went to the store to buy some milk and bread for breakfast on a "
    "sunny day.",
    "The sun was shining and the birds were singing in the big green tree near the house.",
    "Tom had a red ball. He liked to kick it very high in the sky and run after it.",
]
SUFFIXES = [" One day", " Then", " After that", " Suddenly", " The next day", " Later",
            " So", " But"]


def load(n_per_prefix: int = 8) -> list[tuple[int, dict]]:
    """4 prefixes x 8 suffixes, greedy, in the order they are sent."""
    return [(p, {"model": "stories260k", "prompt": PREFIXES[p] + SUFFIXES[i],
                 "max_tokens": 8, "temperature": 0})
            for i in range(n_per_prefix) for p in range(len(PREFIXES))]


async def run_load(url: str) -> list[tuple[int, Answer]]:
    """First one request per prefix (so each prefix is computed once), then the other 28
    together: the same pattern against one server and against the fleet."""
    reqs = load()
    async with aiohttp.ClientSession() as s:
        first = await asyncio.gather(*[stream_completion(s, url, b) for _, b in reqs[:4]])
        rest = await asyncio.gather(*[stream_completion(s, url, b) for _, b in reqs[4:]])
    return list(zip([p for p, _ in reqs], first + rest))


def hit_rate(answers) -> float:
    prompt = sum(a.usage["prompt_tokens"] for _, a in answers)
    cached = sum((a.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for _, a in answers)
    return cached / prompt


@pytest.fixture(scope="module")
def single_server():
    """The same load against one plain server: the reference text and hit rate."""
    async def go():
        server = ServerProcess([])
        await server.start(120)
        url = f"http://127.0.0.1:{server.port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(600):
                    try:
                        async with s.get(url + "/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
            return await run_load(url)
        finally:
            await server.stop(10)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def fleet(ray_cluster):
    # A dead server fails the health check at once (no timeout involved); the generous
    # timeout only keeps a busy CI machine from replacing live replicas.
    cfg = FleetConfig(min_replicas=2, max_replicas=2, num_cpus=0.5,
                      health_check_period_s=1, health_check_timeout_s=30,
                      routing_stats_period_s=0.5, drain_timeout_s=5,
                      server_args=["--max-num-seqs", "4"])
    return deploy(cfg, 8431)


def test_prefixes_stay_on_one_replica_and_text_matches_one_server(fleet, single_server):
    answers = asyncio.run(run_load(fleet))
    ref = single_server
    for (p, a), (_, r) in zip(answers, ref):
        assert a.status == 200 and a.done and a.error is None, a
        assert a.text == r.text, (p, a.text, r.text)
    homes = defaultdict(set)
    for p, a in answers:
        homes[p].add(a.replica)
    assert all(len(h) == 1 for h in homes.values()), f"{dict(homes)}\n{serve_events()}"
    assert len(set().union(*homes.values())) == 2, (
        f"both replicas should take prefixes: {dict(homes)}\n{serve_events()}")
    single, fleet_rate = hit_rate(ref), hit_rate(answers)
    print(f"prefix-cache hit rate: single server {single:.3f}, fleet {fleet_rate:.3f}")
    assert single > 0.5
    assert fleet_rate >= 0.9 * single


def _server_pid(replica_id: str) -> int:
    actor_pid = replica_pids()[replica_id]
    kids = [c for c in psutil.Process(actor_pid).children()
            if "tinyserve" in " ".join(c.cmdline())]
    assert len(kids) == 1, kids
    return kids[0].pid


def test_killed_replica_retries_unstarted_and_fleet_heals(fleet):
    async def go():
        async with aiohttp.ClientSession() as s:
            # Learn which replica owns prefix 0, then pile 8 long requests on it: with
            # --max-num-seqs 4, four stream and four wait.
            warm = await stream_completion(s, fleet, load()[0][1])
            victim = warm.replica
            body = {"model": "stories260k", "max_tokens": 60, "temperature": 0}
            answers = [Answer() for _ in range(8)]
            tasks = [asyncio.create_task(stream_completion(
                s, fleet, {**body, "prompt": PREFIXES[0] + SUFFIXES[i]}, answers[i]))
                for i in range(8)]
            await asyncio.wait_for(answers[0].started.wait(), 60)
            server = psutil.Process(_server_pid(victim))  # (a Ray call: before the sample)
            await asyncio.sleep(0.5)
            started = [a.started.is_set() for a in answers]
            server.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.gather(*tasks)
            # A new request right after the kill, for the victim's prefix: it is retried.
            after = await stream_completion(s, fleet, load()[0][1])
            return victim, started, answers, after, killed_at

    victim, started, answers, after, killed_at = asyncio.run(go())
    print(f"kill: {sum(started)} streaming, {len(started) - sum(started)} not started; "
          f"{sum(a.error is not None for a in answers)} cut off with an error event, "
          f"{sum(a.attempts == 2 for a in answers)} retried and completed")
    assert any(started) and not all(started), started
    # Whether a request had streamed when its server died is what it received: the client's
    # sample above can miss a first token already on the wire when the signal went out.
    for was_started, a in zip(started, answers):
        assert a.status == 200 and a.done, a
        if was_started or a.error is not None:  # streaming: cut off with a clean error event
            assert a.replica == victim and a.text, a
            assert a.error is not None and a.error["code"] == "replica_failed", a
        else:  # had not streamed yet: retried on the other replica, whole answer
            assert a.usage["completion_tokens"] == 60
            if a.replica != victim:  # (on the victim: finished just before the kill)
                assert a.attempts == 2, a
    assert any(a.attempts == 2 for a in answers)
    assert after.status == 200 and after.error is None and after.replica != victim
    # Serve sees the failed health check and replaces the replica.
    wait_for(lambda: victim not in replica_pids() and running_replicas() == 2, 90,
             "the fleet back to 2 healthy replicas")
    print(f"kill: 2 healthy replicas again {time.monotonic() - killed_at:.1f}s after the kill "
          "(or sooner: checked once the answers were in)")
