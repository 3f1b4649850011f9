"""The actor graph in-process with a fake model: admission, batcher, executor, metrics.

No torch and no HTTP: the executor runs a fake step function (the scheduler test's fake KV
executor), so these tests pin down the message flow and the failure handling.
"""

import asyncio
import time

import pytest

from tests.core.test_scheduler import FakeExecutor
from tinyserve.actors.admission import Admission
from tinyserve.actors.batcher import Batcher
from tinyserve.actors.executor import Executor
from tinyserve.actors.lanes import Lane, RequestHandle
from tinyserve.actors.metrics import Metrics
from tinyserve.core.engine_core import CoreConfig, EngineCore
from tinyserve.core.engines import StepFunction
from tinyserve.engine.loading.demo import write_tokenizer
from tinyserve.messages import (
    Abort,
    Accepted,
    Failed,
    SamplingParams,
    StepResult,
    Submit,
)
from tinyserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer(path)


class Graph:
    def __init__(self, tokenizer, execute=None, capacity=8, step_seconds=0.0):
        self.step_seconds = step_seconds
        cfg = CoreConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=32, max_model_len=64, vocab_size=259,
                         eos_token_ids=frozenset({257}))
        self.core = EngineCore(cfg, tokenizer)
        self.fake = FakeExecutor(4)
        self.metrics = Metrics(64, 32)
        self.executor = Executor({"m": StepFunction(execute or self._fake_step)})
        self.batcher = Batcher(self.core, self.executor.inbox, self.metrics, capacity, model="m")
        self.executor.outboxes["m"] = self.batcher.inbox
        self.admission = Admission([Lane("m", self.batcher.inbox, capacity, 64)])
        self.admission.ready = True

    def _fake_step(self, plan):
        time.sleep(self.step_seconds)
        live = []
        for s in plan.seqs:  # the fake KV executor checks tokens against the sequence
            # (read from the worker thread: with overlap the loop may have finished, preempted
            # or advanced the sequence since this step was planned; a stale entry's result is
            # dropped by the scheduler, so the fake skips it rather than check its KV)
            seq = self.core.scheduler.seqs.get(s.seq_id)
            if seq is None or seq.num_preemptions != s.epoch:
                continue
            self.fake.tokens_by_seq[s.seq_id] = list(seq.token_ids[:s.start_pos]) + list(
                s.token_ids)
            live.append(s)
        result = self.fake.execute(plan, {s.seq_id for s in live})
        # byte-level demo vocabulary: keep tokens printable and away from EOS
        outs = tuple(type(o)(o.seq_id, 97 + o.token_id % 26, o.logprob) for o in result.outputs)
        return StepResult(plan.step_id, outs)

    async def __aenter__(self):
        self.executor.start()
        self.tasks = [asyncio.ensure_future(a.run()) for a in (self.batcher, self.admission,
                                                                self.metrics)]
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.executor.stop()

    async def request(self, rid, prompt=(256, 104, 105), max_tokens=5):
        replies = asyncio.Queue(maxsize=max_tokens + 4)
        handle = RequestHandle(rid, replies)
        first = await self.admission.ask([Submit(
            request_id=rid, prompt_token_ids=tuple(prompt), params=SamplingParams(
                max_tokens=max_tokens, temperature=0.0), arrival_time=time.monotonic(),
            handle=handle)])
        if isinstance(first, Failed):
            return first, []
        assert isinstance(first, Accepted)
        outs = []
        try:
            while True:
                out = await asyncio.wait_for(replies.get(), 10)
                outs.append(out)
                if isinstance(out, Failed) or out.finish_reason:
                    handle.done = True
                    return first, outs
        finally:
            handle.close()  # what the API does when the request's handler ends


def test_requests_flow_through_the_actors(tokenizer):
    async def main():
        async with Graph(tokenizer) as g:
            results = await asyncio.gather(*(g.request(i + 1) for i in range(6)))
            for _, outs in results:
                assert outs[-1].finish_reason == "length"
                assert outs[-1].completion_tokens == 5
                assert "".join(o.text for o in outs)
            assert g.batcher.num_requests == 0 and g.core.kv.usage == 0.0
            text = g.metrics.render().decode()
            assert ('tinyserve:request_success_total{finished_reason="length",model="m",'
                    'model_name="m"} 6.0') in text
    asyncio.run(main())


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(tokenizer):
    calls = {"n": 0}

    async def main():
        g = Graph(tokenizer)
        fake_step = g._fake_step

        def flaky(plan):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("CUDA error: an illegal memory access (simulated)")
            return fake_step(plan)

        g.executor.runners["m"] = StepFunction(flaky)
        async with g:
            _, outs = await g.request(1)
            assert isinstance(outs[-1], Failed) and outs[-1].status == 500
            _, outs = await g.request(2)
            assert outs[-1].finish_reason == "length"
            assert not g.executor.task.done() and g.core.kv.usage == 0.0
    asyncio.run(main())


def test_queue_bound_rejects_with_429_and_draining_with_503(tokenizer):
    async def main():
        async with Graph(tokenizer, capacity=1, step_seconds=0.01) as g:
            slow = asyncio.ensure_future(g.request(1, max_tokens=40))
            await asyncio.sleep(0.05)
            rejected, _ = await g.request(2)
            assert isinstance(rejected, Failed) and rejected.status == 429
            assert rejected.retry_after
            await slow
            g.admission.draining = True
            rejected, _ = await g.request(3)
            assert rejected.status == 503
    asyncio.run(main())


def test_abort_frees_blocks_and_ends_the_stream(tokenizer):
    async def main():
        async with Graph(tokenizer) as g:
            replies = asyncio.Queue(maxsize=64)
            assert isinstance(await g.admission.ask([Submit(
                request_id=7, prompt_token_ids=(256, 1, 2, 3, 4, 5), params=SamplingParams(
                    max_tokens=50, temperature=0.0), arrival_time=time.monotonic(),
                handle=RequestHandle(7, replies))]), Accepted)
            await replies.get()  # a first output: it is running
            g.batcher.inbox.put_nowait(Abort(7))
            while True:
                out = await asyncio.wait_for(replies.get(), 10)
                if out.finish_reason:
                    break
            assert out.finish_reason == "abort"
            await asyncio.sleep(0.05)
            assert g.core.kv.usage == 0.0 and g.batcher.num_requests == 0
    asyncio.run(main())


def test_the_engine_refuses_what_ingress_should_have_caught(tokenizer):
    """Defence in depth: a Submit that bypassed ingress's checks is refused with a 400 naming
    the field, and never reaches a step."""
    async def main():
        async with Graph(tokenizer) as g:
            for i, (prompt, params, field) in enumerate([
                    ((256, 10**6), SamplingParams(max_tokens=3), "prompt"),
                    ((256, -1), SamplingParams(max_tokens=3), "prompt"),
                    ((256, 5), SamplingParams(max_tokens=3, top_k=2**31), "top_k"),
                    ((256, 5), SamplingParams(max_tokens=3, stop_token_ids=(10**9,)),
                     "stop_token_ids")]):
                replies = asyncio.Queue(maxsize=8)
                assert isinstance(await g.admission.ask([Submit(
                    request_id=100 + i, prompt_token_ids=prompt, params=params,
                    arrival_time=time.monotonic(), handle=RequestHandle(100 + i, replies))]),
                    Accepted)
                failed = await asyncio.wait_for(replies.get(), 5)
                assert isinstance(failed, Failed) and failed.status == 400, failed
                assert failed.param == field
            _, outs = await g.request(1)
            assert outs[-1].finish_reason == "length"
            assert g.batcher.num_requests == 0 and g.core.kv.usage == 0.0
    asyncio.run(main())
