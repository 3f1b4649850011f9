"""Autoscaling: a sustained queue takes the fleet from 1 replica to 2, and back to 1 when
the load stops, with every request answered (short delays so it fits in a test)."""

# ruff: noqa: E402 (imports below the skip: without the ray extra, collecting is skipping)
import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.ray  # a step of its own in .ci/run

import asyncio
import time

import aiohttp

from tests.fleet.cluster import (
    await_for,
    deploy,
    running_replicas,
)
from tests.fleet.sse import stream_completion
from tinyserve.fleet.app import FleetConfig


def test_sustained_queue_scales_up_and_back_down(ray_cluster):
    cfg = FleetConfig(min_replicas=1, max_replicas=2, num_cpus=0.5,
                      target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=3,
                      metrics_interval_s=0.5, look_back_period_s=1,
                      health_check_period_s=1, health_check_timeout_s=30, drain_timeout_s=5,
                      # The clients' prompts share a prefix: only the load guard moves
                      # them to the new replica.
                      balance_abs_threshold=2, balance_rel_threshold=1.0,
                      routing_stats_period_s=0.5)
    url = deploy(cfg, 8432)
    assert running_replicas() == 1

    async def go():
        answers = []
        stop = asyncio.Event()

        async def client(i: int) -> None:
            async with aiohttp.ClientSession() as s:
                n = 0
                while not stop.is_set():
                    answers.append(await stream_completion(s, url, {
                        "model": "stories260k", "prompt": f"Client {i} says hello {n}",
                        "max_tokens": 24, "temperature": 0}))
                    n += 1

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        t0 = time.monotonic()
        try:
            await await_for(lambda: running_replicas() == 2, 90, "a second replica")
            up = time.monotonic() - t0
            await await_for(lambda: len({a.replica for a in answers}) == 2, 60,
                            "the new replica to answer requests")
        finally:
            stop.set()  # each client finishes the request it is in
            t1 = time.monotonic()
            await asyncio.gather(*clients)
        await await_for(lambda: running_replicas() == 1, 90, "back to one replica")
        return answers, up, time.monotonic() - t1

    answers, up_s, down_s = asyncio.run(go())
    print(f"scaled up after {up_s:.1f}s of load, down {down_s:.1f}s after it began to stop; "
          f"{len(answers)} requests")
    bad = [a for a in answers if a.status != 200 or a.error is not None or not a.done]
    assert not bad, bad[:3]
