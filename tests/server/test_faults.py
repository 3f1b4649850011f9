"""Fault injection on the in-process server (fake model): failing steps, a wedged step, a
crashed batcher, bursts beyond capacity, and a drain that runs out of time.

Each fault must be visible to an operator (/health, /ready, metrics) and every request must be
answered: nobody is left waiting, and nothing is lost that the server said it would serve.
"""

import asyncio
import threading
import time

import aiohttp
import pytest

from tests.server.helpers import completion, post
from tests.server.inprocess import FakeRunner, InProcessServer

# Wall-clock latency bounds: run without a CPU-bound neighbour, after the parallel part (.ci/run).
pytestmark = pytest.mark.serial


@pytest.fixture
def make_server():
    started = []

    def make(runner=None, **cfg) -> InProcessServer:
        srv = InProcessServer(runner, **cfg)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


def test_a_raising_step_fails_only_its_requests_and_the_server_stays_ready(make_server):
    runner = FakeRunner(step_seconds=0.02, poison=7)
    srv = make_server(runner)

    async def main():
        poisoned = post(srv.url, "/v1/completions", completion([1, 7, 9], 8))
        others = [post(srv.url, "/v1/completions", completion([1, 20 + i], 8)) for i in range(5)]
        bad, *good = await asyncio.gather(poisoned, *others)
        assert bad[0] == 500 and bad[1]["error"]["type"] == "server_error"
        # Requests batched with the poisoned one failed with it (500), never hung; a request
        # sent after it completes, and the server still says ready.
        assert all(status in (200, 500) for status, _, _ in good)
        after = await post(srv.url, "/v1/completions", completion([1, 30], 8))
        assert after[0] == 200 and after[1]["usage"]["completion_tokens"] == 8
        assert (await _get(srv.url + "/ready"))[0] == 200
        assert (await _get(srv.url + "/health"))[0] == 200
        async with aiohttp.ClientSession() as session, session.get(srv.url + "/metrics") as r:
            metrics = await r.text()
        assert 'request_errors_total{code="500"}' in metrics
        assert 'finished_reason="error"' not in metrics  # a failure is not a success

    asyncio.run(main())
    assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "requests": 0,
                               "live": 0}


def test_consecutive_failed_steps_mark_the_server_unhealthy(make_server):
    srv = make_server(FakeRunner(), max_failed_steps=3)
    srv.runner.fail_next = 100  # after the warm-up

    async def main():
        for _ in range(3):
            status, _, _ = await post(srv.url, "/v1/completions", completion([1, 5], 4))
            assert status in (500, 503)
        status, body = await _health_within(srv.url, 1.0)
        assert status == 503 and "consecutive" in body["reason"]
        status, body, headers = await post(srv.url, "/v1/completions", completion([1, 5], 4))
        assert status == 503 and "Retry-After" in headers

    asyncio.run(main())


async def _health_within(url: str, seconds: float) -> tuple[int, dict]:
    """/health as soon as it is not 200, or the 200 after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        status, body = await _get(url + "/health")
        if status != 200 or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.05)


def test_a_wedged_step_turns_health_503_and_answers_everyone(make_server):
    srv = make_server(FakeRunner(), step_timeout_s=1.0)
    srv.runner.hang = threading.Event()  # after the warm-up: every step blocks from now on

    async def main():
        t0 = time.monotonic()
        pending = [asyncio.ensure_future(post(srv.url, "/v1/completions", completion([1, i], 4)))
                   for i in range(3, 7)]
        streamed = asyncio.ensure_future(_stream_events(srv.url, completion([1, 9], 4)))
        while (await _get(srv.url + "/health"))[0] == 200:
            assert time.monotonic() - t0 < 1.0 + 1.0, "/health still 200 after timeout + 1 s"
            await asyncio.sleep(0.05)
        print(f"\nwedged step (--step-timeout 1): /health 503 after {time.monotonic() - t0:.2f} s")
        statuses = await asyncio.wait_for(asyncio.gather(*pending), 2.0)
        assert all(status == 503 for status, _, _ in statuses), statuses
        events = await asyncio.wait_for(streamed, 2.0)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        status, body = await _get(srv.url + "/health")
        assert status == 503 and "wedged" in body["reason"]
        assert (await _get(srv.url + "/ready"))[0] == 503

    asyncio.run(main())
    # Shutting down does not wait for the wedged step (the process must be able to exit).
    t0 = time.monotonic()
    srv.call(srv.server.close(), timeout=10)
    assert time.monotonic() - t0 < 5 and srv.server.executor.busy


async def _stream_events(url: str, body: dict) -> list[str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                   json={**body, "stream": True}) as r:
        if r.status != 200:
            return [f"status {r.status}"]
        return [line.decode().strip()[6:] async for line in r.content
                if line.startswith(b"data: ")]


def test_a_crashed_batcher_turns_health_503_and_leaves_nobody_waiting(make_server):
    srv = make_server(FakeRunner(step_seconds=0.05))

    def broken_schedule():
        raise RuntimeError("injected scheduler bug")

    async def main():
        running = asyncio.ensure_future(post(srv.url, "/v1/completions", completion([1, 4], 50)))
        await asyncio.sleep(0.3)  # it is generating
        srv.server.batcher.core.schedule = broken_schedule  # the next step cannot be planned
        status, _, _ = await asyncio.wait_for(running, 3.0)
        assert status == 503
        status, body = await _get(srv.url + "/health")
        assert status == 503 and "batcher" in body["reason"]
        status, _, _ = await asyncio.wait_for(
            post(srv.url, "/v1/completions", completion([1, 4], 5)), 3.0)
        assert status == 503

    asyncio.run(main())


async def _burst(url: str, n: int, on_answer=None) -> list[tuple[int, str | None, dict]]:
    async def one(s, i):
        async with s.post(url + "/v1/completions", json=completion([1, 3 + i % 200], 3)) as r:
            got = r.status, r.headers.get("Retry-After"), await r.json()
        if on_answer is not None:
            on_answer(got)
        return got

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(60)) as s:
        return await asyncio.gather(*(one(s, i) for i in range(n)))


def test_a_burst_within_capacity_is_all_served(make_server):
    srv = make_server(max_num_seqs=64, max_waiting=936)
    results = asyncio.run(_burst(srv.url, 1000))
    assert sorted({status for status, _, _ in results}) == [200]
    assert all(body["usage"]["completion_tokens"] == 3 for _, _, body in results)
    assert srv.wait_idle()["requests"] == 0


def test_a_burst_beyond_capacity_gets_exactly_the_excess_429(make_server):
    srv = make_server(FakeRunner(), max_num_seqs=4, max_waiting=96, step_timeout_s=120)
    hold = srv.runner.hang = threading.Event()  # steps wait until admission answered everyone

    async def main():
        rejected = []
        burst = asyncio.ensure_future(_burst(srv.url, 1000, on_answer=rejected.append))
        deadline = time.monotonic() + 60
        while len(rejected) < 900 and not burst.done():  # every decision is in
            assert time.monotonic() < deadline, len(rejected)
            await asyncio.sleep(0.05)
        hold.set()
        return await burst

    results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert statuses.count(200) == 100 and statuses.count(429) == 900, \
        {s: statuses.count(s) for s in set(statuses)}
    assert all(retry and int(retry) >= 1 for status, retry, _ in results if status == 429)
    assert all(body["error"]["type"] == "rate_limit_error"
               for status, _, body in results if status == 429)
    assert srv.wait_idle()["requests"] == 0


def test_requests_cut_by_the_drain_timeout_end_with_503(make_server):
    srv = make_server(FakeRunner(step_seconds=0.05), drain_timeout_s=0.5)

    async def main():
        whole = asyncio.ensure_future(post(srv.url, "/v1/completions", completion([1, 4], 100)))
        streamed = asyncio.ensure_future(_stream_events(srv.url, completion([1, 5], 100)))
        await asyncio.sleep(0.3)
        srv.server.request_stop()
        late = await post(srv.url, "/v1/completions", completion([1, 6], 2))
        assert late[0] == 503
        await srv.server.drain()
        return await whole, await streamed

    (status, body, _), events = srv.call(main())  # drain runs on the server's own loop
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert events[-1] == "[DONE]" and '"error"' in events[-2]
    assert not any('"finish_reason":"abort"' in e for e in events)
