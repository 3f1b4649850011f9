"""Batching, prefix caching, preemption and disconnects, observed through the HTTP API and
/metrics of a real server."""

import asyncio
import time

import aiohttp
import pytest

from tests.server.conftest import get
from tests.server.helpers import completion, post, run

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park. One day, she saw a big, red ball. She wanted to play with it, but it was too "
         "high. Lily asked her mom for help.")


async def _texts(url, bodies):
    results = await asyncio.gather(*(post(url, "/v1/completions", b) for b in bodies))
    assert all(status == 200 for status, _, _ in results), results
    return [r["choices"][0]["text"] for _, r, _ in results]


def test_sixteen_concurrent_requests_equal_their_solo_runs(server):
    words = STORY.split()
    bodies = [completion(" ".join(words[: 2 + (3 * i) % 29]), max_tokens=3 + i % 6)
              for i in range(16)]
    together = run(_texts(server.url, bodies))
    alone = [run(_texts(server.url, [b]))[0] for b in bodies]
    assert together == alone
    assert len(set(together)) > 8  # different prompts, different texts


def test_shared_prefix_hits_the_cache_and_prefills_only_the_tail(server, stories_dir):
    from tinyserve.text.tokenizer import Tokenizer

    ids = Tokenizer(stories_dir).encode(STORY)
    assert len(ids) >= 70
    prefix = ids[:64]
    first = prefix + [300, 301, 302]
    second = prefix + [400, 401, 402, 403, 404]
    status, _, _ = run(post(server.url, "/v1/completions", completion(first, 1)))
    assert status == 200
    hits0 = server.metric("tinyserve:prefix_cache_hits_total")
    computed0 = server.metric("tinyserve:prompt_tokens_computed_total")
    status, body, _ = run(post(server.url, "/v1/completions", completion(second, 1)))
    assert status == 200
    assert server.metric("tinyserve:prefix_cache_hits_total") - hits0 == 64
    assert server.metric("tinyserve:prompt_tokens_computed_total") - computed0 == 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_tiny_kv_pool_preempts_without_losing_or_changing_anything(server, launch):
    words = STORY.split()
    bodies = [completion(" ".join(words[i: i + 12]), max_tokens=16) for i in range(8)]
    reference = run(_texts(server.url, bodies))
    small = launch("--num-kv-blocks", "12", "--block-size", "16", "--max-model-len", "192")
    got = run(_texts(small.url, bodies))
    assert got == reference
    assert small.metric("tinyserve:num_preemptions_total") > 0
    assert small.metric("tinyserve:kv_cache_usage_perc") == 0.0
    assert small.metric("tinyserve:request_success_total", '{finished_reason="length"}') == 8


async def _disconnect_mid_stream(url):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions",
                          json=completion(STORY[:60], max_tokens=300, stream=True)) as r:
            seen = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    seen += 1
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream
    return seen


async def _disconnect_while_waiting(url):
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(url + "/v1/completions",
                                            json=completion(STORY[:50], max_tokens=300)))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _wait_metric(server, name, value, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = server.metric(name)
        if got == value:
            return got
        time.sleep(0.2)
    return got


def test_disconnects_abort_and_free_every_block(server):
    aborted0 = server.metric("tinyserve:request_success_total", '{finished_reason="abort"}')
    assert run(_disconnect_mid_stream(server.url)) == 2
    run(_disconnect_while_waiting(server.url))
    assert _wait_metric(server, "tinyserve:kv_cache_usage_perc", 0.0) == 0.0
    assert _wait_metric(server, "tinyserve:num_requests_running", 0.0) == 0.0
    aborted = server.metric("tinyserve:request_success_total", '{finished_reason="abort"}')
    assert aborted - aborted0 == 2
    status, _, _ = run(post(server.url, "/v1/completions", completion("Hi", 2)))
    assert status == 200  # still serving


async def _probe_during_prefill(url):
    async with aiohttp.ClientSession() as s:
        # A first token no other request used: the prefix cache cannot shorten this prefill.
        long_prompt = [3 + time.time_ns() % 500] + list(range(3, 449))
        job = asyncio.ensure_future(s.post(url + "/v1/completions",
                                           json=completion(long_prompt, max_tokens=1)))
        await asyncio.sleep(0.3)  # the prefill is under way in the executor thread
        latencies = []
        for _ in range(8):
            t = time.perf_counter()
            async with s.get(url + "/health") as r:
                assert r.status == 200
            latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)
        still_running = not job.done()
        resp = await job
        assert resp.status == 200
        return latencies, still_running


@pytest.mark.serial  # a wall-clock bound: no CPU-bound neighbour (.ci/run)
def test_health_answers_quickly_while_a_long_prefill_runs(server):
    latencies, still_running = run(_probe_during_prefill(server.url))
    assert still_running, "the prefill ended before the probes: the test measured nothing"
    assert max(latencies) < 0.1, latencies


def test_kv_usage_returns_to_zero_when_idle(server):
    assert _wait_metric(server, "tinyserve:kv_cache_usage_perc", 0.0) == 0.0
    status, text = get(server.url + "/metrics")
    assert status == 200
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "cache_config_info", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "request_success_total"):
        assert f"tinyserve:{name}" in text, name
