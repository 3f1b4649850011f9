"""Step N+1 launched before step N is finished (issue 19): its PLACEHOLDER input tokens taken
on the device from N's sampled tensor, the result identical to running the steps one after
the other with the tokens filled on the host; the executor overlapping launch and finish;
through the whole server with overlap on and off. (On the CPU every launch completes at once,
but the same code runs: the fill kernel, the staging, the order of launch and finish.)"""

import asyncio

import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.actors.executor import Executor
from tinyserve.engine.running.runner import ModelRunner
from tinyserve.messages import PLACEHOLDER, GrammarSpec, ScheduledSeq, StepPlan

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40)


@pytest.fixture(scope="module")
def llms(stories_dir):
    return {eager: LLM(str(stories_dir), dtype="float32", max_num_seqs=4, num_kv_blocks=32,
                       enforce_eager=eager) for eager in (False, True)}


def prefill(seq_id: int, prompt: list[int], blocks: tuple[int, ...], params=GREEDY):
    return ScheduledSeq(seq_id, tuple(prompt), 0, blocks, True, params, seq_id)


def decode(seq_id: int, token: int, pos: int, params=GREEDY, seed: int = 0):
    return ScheduledSeq(seq_id, (token,), pos, (), True, params, seed, first_block=1)


def run_two_steps(runner: ModelRunner, overlapped: bool, mixed: bool):
    """A prefill of three prompts (step 1), then their first decode (step 2; ``mixed``: with a
    fourth prompt's prefill beside them, the eager path) -> both steps' sampled tokens."""
    prompts = {1: [1, 403, 300], 2: [1, 200], 3: [1, 7, 8, 9, 10]}
    step1 = StepPlan(1, tuple(prefill(i, p, (10 + i,), SAMPLED if i == 2 else GREEDY)
                              for i, p in prompts.items()))
    extra = (prefill(4, [1, 50, 60], (20,)),) if mixed else ()

    def step2(tokens: dict[int, int]) -> StepPlan:
        return StepPlan(2, tuple(decode(i, tokens.get(i, PLACEHOLDER), len(p),
                                        SAMPLED if i == 2 else GREEDY, seed=7)
                                 for i, p in prompts.items()) + extra)

    if overlapped:  # as the executor does: launch 2 (placeholders) before finishing 1
        first = runner.launch(step1)
        second = runner.launch(step2({}))
        r1, r2 = runner.finish(first), runner.finish(second)
    else:  # one after the other, the tokens filled in on the host
        r1 = runner.execute(step1)
        r2 = runner.execute(step2({o.seq_id: o.token_id for o in r1.outputs}))
    runner.execute(StepPlan(3, (), freed=(1, 2, 3, 4)))
    return ([(o.seq_id, o.token_id) for o in r1.outputs],
            [(o.seq_id, o.token_id, round(o.logprob, 5)) for o in r2.outputs])


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("eager", [False, True])
def test_placeholders_filled_on_the_device_equal_the_host_path(llms, eager, mixed, monkeypatch):
    runner = llms[eager].engine.runner
    fills = []
    fill = runner._fill
    monkeypatch.setattr(runner, "_fill", lambda ids, pairs: (fills.append(len(pairs)),
                                                             fill(ids, pairs)))
    want = run_two_steps(runner, overlapped=False, mixed=mixed)
    assert sum(fills) == 0  # the host path has no placeholders left
    got = run_two_steps(runner, overlapped=True, mixed=mixed)
    assert sum(fills) == 3  # the three decodes' tokens came from step 1 on the device
    assert got == want


def test_a_placeholder_whose_source_did_not_sample_is_left_out(llms):
    runner = llms[True].engine.runner
    runner.launch(StepPlan(1, (prefill(1, [1, 403], (10,)),)))
    launched = runner.launch(StepPlan(2, (decode(1, PLACEHOLDER, 2),
                                          decode(9, PLACEHOLDER, 2))))  # 9: not in step 1
    assert [o.seq_id for o in runner.finish(launched).outputs] == [1]
    runner.execute(StepPlan(3, (), freed=(1,)))


class OnTheDevice:
    """A launched step as a GPU's looks: not done when launch returns (asked again, it is)."""

    def __init__(self, launched):
        self.launched, self.asked = launched, 0

    def ready(self) -> bool:
        self.asked += 1
        return self.asked > 1


def test_the_executor_launches_the_next_step_before_finishing_one(llms):
    runner = llms[False].engine.runner
    order = []

    class Watched:
        fills_on_device = True

        def launch(self, plan):
            order.append(("launch", plan.step_id))
            return OnTheDevice(runner.launch(plan))

        def finish(self, pending):
            order.append(("finish", pending.launched.step_id))
            return runner.finish(pending.launched)

    async def main():
        ex = Executor({"m": Watched()})
        out = asyncio.Queue()
        ex.outboxes["m"] = out
        ex.start()
        try:
            assert await ex.call_on_worker(lambda: 42) == 42
            with ex._ready:  # both queued at once: the worker finds step 2 behind step 1
                ex._jobs["m"].append(("m", StepPlan(1, (prefill(1, [1, 403], (10,)),)),
                                      asyncio.get_running_loop()))
                ex._jobs["m"].append(("m", StepPlan(2, (decode(1, PLACEHOLDER, 2),)),
                                      asyncio.get_running_loop()))
                ex._ready.notify()
            results = [await asyncio.wait_for(out.get(), 60) for _ in range(2)]
            ex.inbox.put_nowait(("m", StepPlan(3, (), freed=(1,))))
            await asyncio.wait_for(out.get(), 60)
            return results
        finally:
            await ex.stop()

    r1, r2 = asyncio.run(main())
    assert [r.step_id for r in (r1, r2)] == [1, 2] and r1.error is None and r2.error is None
    assert order[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("finish", 2)]


def test_a_step_done_at_launch_is_finished_before_the_next_is_launched(llms):
    """On the CPU a step is done when launch returns: its result goes out at once, not a
    step later behind the next one."""
    runner = llms[False].engine.runner
    order = []

    class Watched:
        fills_on_device = True

        def launch(self, plan):
            order.append(("launch", plan.step_id))
            return runner.launch(plan)

        def finish(self, launched):
            order.append(("finish", launched.step_id))
            return runner.finish(launched)

    async def main():
        ex = Executor({"m": Watched()})
        out = asyncio.Queue()
        ex.outboxes["m"] = out
        ex.start()
        try:
            with ex._ready:
                ex._jobs["m"].append(("m", StepPlan(1, (prefill(1, [1, 403], (10,)),)),
                                      asyncio.get_running_loop()))
                ex._jobs["m"].append(("m", StepPlan(2, (decode(1, PLACEHOLDER, 2),)),
                                      asyncio.get_running_loop()))
                ex._ready.notify()
            results = [await asyncio.wait_for(out.get(), 60) for _ in range(2)]
            ex.inbox.put_nowait(("m", StepPlan(3, (), freed=(1,))))
            await asyncio.wait_for(out.get(), 60)
            return results
        finally:
            await ex.stop()

    r1, r2 = asyncio.run(main())
    assert r1.error is None and r2.error is None and r2.outputs
    assert order[:4] == [("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2)]
    want = llms[False].generate([[1, 403]], SamplingParams(max_tokens=2, temperature=0.0))
    assert [r1.outputs[0].token_id, r2.outputs[0].token_id] == list(want[0].token_ids)


def test_a_step_that_needs_host_tokens_waits_for_the_one_before(llms):
    """Penalties and grammars read the output so far: that step is launched after the one
    before it finished, its placeholders filled on the host."""
    runner = llms[False].engine.runner
    order = []

    class Watched:
        fills_on_device = True

        def launch(self, plan):
            order.append(("launch", plan.step_id, plan.seqs[0].token_ids[-1] if plan.seqs
                          else None))
            return runner.launch(plan)

        def finish(self, launched):
            order.append(("finish", launched.step_id))
            return runner.finish(launched)

    guided = SamplingParams(temperature=0.0, guided=GrammarSpec("regex", "[a-z]+"))

    async def main():
        ex = Executor({"m": Watched()})
        out = asyncio.Queue()
        ex.outboxes["m"] = out
        ex.start()
        try:
            loop = asyncio.get_running_loop()
            with ex._ready:
                ex._jobs["m"].append(("m", StepPlan(1, (prefill(1, [1, 403], (10,), guided),)),
                                      loop))
                ex._jobs["m"].append(("m", StepPlan(2, (ScheduledSeq(
                    1, (PLACEHOLDER,), 2, (), True, guided, 0, first_block=1,
                    output_ids=(PLACEHOLDER,)),)), loop))
                ex._ready.notify()
            results = [await asyncio.wait_for(out.get(), 60) for _ in range(2)]
            ex.inbox.put_nowait(("m", StepPlan(3, (), freed=(1,))))
            await asyncio.wait_for(out.get(), 60)
            return results
        finally:
            await ex.stop()

    r1, r2 = asyncio.run(main())
    assert r1.error is None and r2.error is None, (r1, r2)
    assert [o[:2] for o in order[:4]] == [("launch", 1), ("finish", 1), ("launch", 2),
                                          ("finish", 2)]
    assert order[2][2] == r1.outputs[0].token_id  # filled on the host before the launch
