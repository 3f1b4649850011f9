"""The step loop's overlap (a step planned while the previous one runs) on the in-process
server: the same answers with it on and off, stop strings and clients leaving while the next
step is already in flight, failing steps, and the executor never waiting for the loop."""

import asyncio
import time

import aiohttp
import pytest

from tests.server.helpers import completion
from tests.server.inprocess import FakeRunner, InProcessServer, next_token


async def _answers(url: str, bodies: list[dict]) -> list[tuple[int, str, str, int]]:
    async with aiohttp.ClientSession() as s:
        async def one(body):
            async with s.post(url + "/v1/completions", json=body) as r:
                got = await r.json()
                if r.status != 200:
                    return r.status, "", "", 0
                c = got["choices"][0]
                return r.status, c["text"], c["finish_reason"], got["usage"]["completion_tokens"]
        return await asyncio.gather(*(one(b) for b in bodies))


def _workload() -> list[dict]:
    bodies = []
    for i in range(24):
        prompt = [1, 3 + i, 40 + 2 * i]
        kw = {}
        if i % 3 == 0:  # a stop string from inside its own greedy text: ends it early
            kw["stop"] = [_text_piece(prompt)]
        bodies.append(completion(prompt, max_tokens=5 + i % 9, **kw))
    return bodies


def _text_piece(prompt: list[int]) -> str:
    """The text of the fake model's 4th token for this prompt (a stop string it will hit)."""
    from tinyserve.models import STORIES260K
    from tinyserve.text.tokenizer import Tokenizer

    toks, last = list(prompt), prompt[-1]
    for _ in range(4):
        last = next_token(last, len(toks))
        toks.append(last)
    return Tokenizer(STORIES260K).decode([last]).strip() or "x"


@pytest.mark.parametrize("step_seconds", [0.0, 0.01])
def test_answers_are_the_same_with_overlap_on_and_off(step_seconds):
    bodies = _workload()
    results = {}
    for overlap in (False, True):
        srv = InProcessServer(FakeRunner(step_seconds=step_seconds), overlap=overlap,
                              max_num_seqs=8, max_num_batched_tokens=16)
        try:
            results[overlap] = asyncio.run(_answers(srv.url, bodies))
            assert srv.wait_idle()["kv_usage"] == 0
        finally:
            srv.stop()
    assert results[True] == results[False]
    assert all(status == 200 for status, *_ in results[True])
    assert any(reason == "stop" for _, _, reason, _ in results[True])


@pytest.mark.parametrize("overlap", [True, False])
def test_the_executor_runs_the_next_step_while_the_loop_is_busy(overlap):
    """With overlap, once the step behind the running one is planned, the worker goes on to
    it without waiting for the event loop: the loop stalls right after planning it, and
    another step still starts. Without overlap, none does."""
    runner = FakeRunner(step_seconds=0.02)
    srv = InProcessServer(runner, max_num_seqs=4, overlap=overlap)
    batcher = srv.server.batcher
    launch, seen = batcher._launch, []

    def launch_then_stall():
        launched = launch()
        if launched and not seen and runner.steps > 5 and len(batcher._in_flight) == (
                2 if overlap else 1):
            before = runner.steps
            time.sleep(0.2)  # on the loop: nothing else on it runs meanwhile
            seen.append(runner.steps - before)
        return launched

    batcher._launch = launch_then_stall

    async def main():
        async with aiohttp.ClientSession() as s:
            r = await s.post(srv.url + "/v1/completions", json=completion([1, 5], max_tokens=40))
            assert r.status == 200
            await r.read()

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    # (without overlap the stall comes right after a launch: at most that step runs)
    assert seen and (seen[0] >= 1 if overlap else seen[0] <= 1), seen


class SlowToFail(FakeRunner):
    """Computes for ``delay`` seconds, then fails a step holding the poisoned token (as a
    kernel fault on certain inputs would), so the step planned behind it is already queued."""

    delay: float = 0.1

    def execute(self, plan):
        time.sleep(self.delay)
        return super().execute(plan)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_step_takes_only_its_requests_not_the_step_planned_behind_it(overlap):
    """The poisoned prompt is prefilled in chunks: the step behind the failed one holds its
    next chunk (and innocent new requests). That chunk must not run: the innocents answer
    200 and the one bad request counts as one failed step, not two."""
    runner = SlowToFail()
    srv = InProcessServer(runner, overlap=overlap, max_num_batched_tokens=8, max_failed_steps=2)

    async def main():
        async with aiohttp.ClientSession() as s:
            async def post(body):
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    return r.status

            assert await post(completion([1, 5], max_tokens=3)) == 200  # (learns step time)
            runner.poison = 7
            bad = asyncio.ensure_future(post(completion([1] + [7] * 11, max_tokens=4)))
            await asyncio.sleep(0.03)  # its first chunk's step is running
            innocents = [asyncio.ensure_future(post(completion([1, 20 + i], max_tokens=4)))
                         for i in range(3)]
            return await bad, [await t for t in innocents]

    try:
        bad, innocents = asyncio.run(main())
        assert srv.wait_idle()["kv_usage"] == 0
        health = asyncio.run(_health(srv.url))
    finally:
        srv.stop()
    assert bad == 500 and innocents == [200, 200, 200] and health == 200


async def _health(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return r.status


def test_the_real_model_answers_the_same_with_overlap_on_and_off(stories_dir):
    """stories260k through the whole server (Triton kernels on the interpreter): greedy
    answers, stop strings included, are identical with steps planned ahead and without."""
    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine

    engine = DeviceEngine(EngineConfig(model=str(stories_dir), num_kv_blocks=64, max_model_len=256))
    bodies = [completion(p, max_tokens=12 + 3 * i, **({"stop": ["."]} if i % 2 else {}))
              for i, p in enumerate(["Once upon a time", "The cat", "Lily and Ben went",
                                     "One day, a big"])]
    results = {}
    for overlap in (False, True):
        srv = InProcessServer(engine=engine, overlap=overlap, max_num_seqs=4)
        try:
            results[overlap] = asyncio.run(_answers(srv.url, bodies))
        finally:
            srv.stop()
    assert results[True] == results[False]
    assert all(status == 200 and text for status, text, _, _ in results[True])
