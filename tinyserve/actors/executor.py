"""Executor actor: runs each StepPlan on its model in a worker thread.

The forward pass runs off the event loop, so /health and new requests are answered while a
step computes. The inbox takes (model name, StepPlan) and hands it to the worker thread at
once; each model's batcher keeps at most two steps in flight (the one running and the one
planned behind it, so the worker never waits for the event loop between steps); the worker
takes them round robin over the models with a step waiting, so busy models alternate step by
step. A planned-ahead step holds PLACEHOLDER tokens where the step before it samples.

The worker launches a step (ModelRunner.launch queues it on the device and returns), then
finishes the one before it (waits for its tokens, the step's one host sync) and hands that
result straight to the model's batcher inbox: the device runs step N+1 while the host reads
N's tokens, and N+1's placeholders are filled on the device from N's sampled tensor. A step
whose sequences need N's tokens on the host (penalties, grammars) is launched after N is
finished, its placeholders filled here. With nothing new to launch the worker waits for the
oldest step or for a new one, whichever comes first. A runner whose launch hands back the
StepResult (``core.engines.StepFunction``, the tests' fakes) runs each step whole.
A step that raises becomes a StepResult with ``error`` set; the actor keeps serving.
``busy_since`` and ``failures`` (consecutive failed steps per model) are the snapshots the
supervisor reads to see a wedged device or a failing model.

The worker is one daemon thread, not a ThreadPoolExecutor: a wedged step never returns, and
the interpreter joins pool threads at exit, so a wedged pool thread would keep the process
(that the orchestrator is trying to restart) alive forever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from tinyserve.core.engines import Runner
from tinyserve.messages import PLACEHOLDER, StepPlan, StepResult

log = logging.getLogger(__name__)

STOP_WAIT_BUSY_S = 2.0  # at stop, how long a running step may take to end (GPU steps: ms)


@dataclass(slots=True)
class _InFlight:
    model: str
    plan: StepPlan
    launched: Any  # the runner's handle (an execute-only runner's: the StepResult itself)
    loop: asyncio.AbstractEventLoop
    since: float  # time.monotonic() at launch


class Executor:
    def __init__(self, runners: dict[str, Runner]) -> None:
        # Each model's runner (core/engines.py): owns that model's weights and KV tensors.
        self.runners = runners
        self.outboxes: dict[str, asyncio.Queue] = {}  # each model's batcher inbox (the server's)
        # Batchers put (model, plan) here; it goes straight to the worker thread (no relay
        # through the event loop, which may be busy exactly when the worker needs the plan).
        self.inbox = _Handoff(self)
        self.task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set and cleared by the worker thread itself, so cancelling the task cannot hide a
        # step that is still running.
        # time.monotonic() when the oldest step still in flight was launched
        self.busy_since: float | None = None
        self.failures = dict.fromkeys(runners, 0)  # consecutive failed steps, per model
        # Worker thread only: each model's last step's sampled tokens, for the placeholders
        # of the step planned behind it.
        self._sampled: dict[str, dict[int, int]] = {name: {} for name in runners}
        # ... and the sequences of its last step if that step failed: the batcher ends them,
        # so their entries in the step planned behind it (a placeholder, or the next chunk of
        # a prompt) must not run - they could fail the same way and take others with them.
        self._failed: dict[str, frozenset[int]] = dict.fromkeys(runners, frozenset())
        # Steps handed to the worker, per model; it takes them round robin over the models.
        self._jobs: dict[str, collections.deque] = {name: collections.deque() for name in runners}
        self._calls: collections.deque = collections.deque()  # call_on_worker's, first
        self._order = list(runners)
        self._next = 0
        self._ready = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="tinyserve-step", daemon=True)

    def start(self) -> asyncio.Task:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        self.task = asyncio.get_running_loop().create_task(self.run(), name="executor")
        return self.task

    @property
    def busy(self) -> bool:
        return self.busy_since is not None

    def _take(self, wait: bool = True) -> tuple | None:
        """The next job, round robin over the models that have one; None: stopping, or
        (``wait`` False) nothing queued now."""
        with self._ready:
            while True:
                if self._stopping:
                    return None
                if self._calls:
                    return self._calls.popleft()
                for i in range(len(self._order)):
                    model = self._order[(self._next + i) % len(self._order)]
                    if self._jobs[model]:
                        self._next = (self._next + i + 1) % len(self._order)
                        return self._jobs[model].popleft()
                if not wait:
                    return None
                self._ready.wait()

    def _wait_for_step_or_job(self, oldest: _InFlight) -> None:
        """Until the oldest step's tokens are ready or a new job is queued (polled: a
        condition cannot wait on a CUDA event)."""
        with self._ready:
            while not _done(oldest) and not self._stopping and not self._queued():
                self._ready.wait(0.0002)

    def _queued(self) -> bool:
        return bool(self._calls) or any(self._jobs.values())

    def _worker(self) -> None:
        inflight: collections.deque[_InFlight] = collections.deque()
        while True:
            job = self._take(wait=not inflight)
            if job is None:
                if not inflight:
                    return  # stopping, nothing left in flight
                if self._stopping:
                    self._finish(inflight.popleft(), inflight)
                    continue
                self._wait_for_step_or_job(inflight[0])
                if not self._queued():
                    self._finish(inflight.popleft(), inflight)
                continue
            model, plan, loop = job
            if model is None:  # call_on_worker: run alone, nothing in flight
                while inflight:
                    self._finish(inflight.popleft(), inflight)
                plan()
                continue
            runner = self.runners[model]
            if not runner.fills_on_device or _needs_host_tokens(plan):
                while any(f.model == model for f in inflight):  # its previous tokens, here
                    self._finish(inflight.popleft(), inflight)
                plan = self._fill_placeholders(model, plan)
            else:
                plan = self._drop_failed(model, plan)
            self._failed[model] = frozenset()
            if not inflight:
                self.busy_since = time.monotonic()
            try:
                launched = runner.launch(plan) if plan.seqs or plan.freed \
                    else StepResult(plan.step_id, ())
            except Exception as e:  # a failed step must not take the server down
                while any(f.model == model for f in inflight):  # results stay in step order
                    self._finish(inflight.popleft(), inflight)
                self._deliver(model, loop, self._failure(model, plan, e))
                self.busy_since = inflight[0].since if inflight else None
                continue
            inflight.append(_InFlight(model, plan, launched, loop, time.monotonic()))
            # The newest runs on while the host reads the oldest; a step already done (the
            # CPU's are done when launch returns) is finished at once: holding its result
            # until the next one ran would cost its tokens a whole step.
            while inflight and (len(inflight) > 1 or _done(inflight[0])):
                self._finish(inflight.popleft(), inflight)

    def _finish(self, step: _InFlight, inflight: collections.deque) -> None:
        """Wait for a launched step's tokens, record them, and deliver its result."""
        model, plan = step.model, step.plan
        try:
            if isinstance(step.launched, StepResult):
                result = step.launched
            else:
                result = self.runners[model].finish(step.launched)
            if plan.seqs:
                if not result.seconds:
                    result = msgspec.structs.replace(
                        result, seconds=time.monotonic() - step.since)
                self._sampled[model] = {o.seq_id: o.token_id for o in result.outputs}
                self.failures[model] = 0
        except Exception as e:
            result = self._failure(model, plan, e)
        self.busy_since = inflight[0].since if inflight else None
        self._deliver(model, step.loop, result)

    def _failure(self, model: str, plan: StepPlan, e: Exception) -> StepResult:
        log.error("%s: step %d failed", model, plan.step_id, exc_info=e)
        self._sampled[model] = {}
        self._failed[model] = frozenset(s.seq_id for s in plan.seqs)
        self.failures[model] += 1
        return StepResult(plan.step_id, (), error=f"{type(e).__name__}: {e}")

    def _deliver(self, model: str, loop: asyncio.AbstractEventLoop, result: StepResult) -> None:
        # Straight to the batcher's inbox (sized for it); the next job is already queued
        # here, so the worker goes on without waiting for the loop.
        try:
            loop.call_soon_threadsafe(_deliver, self.outboxes[model], result)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _drop_failed(self, model: str, plan: StepPlan) -> StepPlan:
        """The plan without the sequences of the model's last step if it failed (the batcher
        ends them; their next entries could fail the same way and take others with them)."""
        failed = self._failed[model]
        if not failed:
            return plan
        return msgspec.structs.replace(
            plan, seqs=tuple(s for s in plan.seqs if s.seq_id not in failed))

    async def call_on_worker(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the worker thread, with no step in flight (the warm-up: a CUDA graph is
        captured on the thread that will replay it, with nothing else touching the device)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 (handed to the awaiting task)
                loop.call_soon_threadsafe(_settle, done, None, e)
            else:
                loop.call_soon_threadsafe(_settle, done, out, None)
        with self._ready:
            self._calls.append((None, run, loop))
            self._ready.notify()
        return await done

    def _fill_placeholders(self, model: str, plan: StepPlan) -> StepPlan:
        """Put the tokens the model's previous step sampled where this plan could only hold a
        place for them. A sequence of a previous step that failed, or whose token is missing,
        is left out: the batcher has ended it, and its result here would be stale anyway."""
        failed = self._failed[model]
        if not failed and not any(s.token_ids and s.token_ids[-1] == PLACEHOLDER
                                  for s in plan.seqs):
            return plan
        sampled = self._sampled[model]
        seqs = []
        for s in plan.seqs:
            if s.seq_id in failed:
                continue
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
                token = sampled.get(s.seq_id)
                if token is None:
                    continue
                s = msgspec.structs.replace(s, token_ids=s.token_ids[:-1] + (token,))
                if s.output_ids and s.output_ids[-1] == PLACEHOLDER:  # the same token
                    s = msgspec.structs.replace(s, output_ids=s.output_ids[:-1] + (token,))
            seqs.append(s)
        return msgspec.structs.replace(plan, seqs=tuple(seqs))

    def _submit(self, model: str, plan: StepPlan) -> None:
        with self._ready:
            self._jobs[model].append((model, plan, self._loop))
            self._ready.notify()

    async def run(self) -> None:
        """The actor's lifetime: it ends (a fault the supervisor sees) if the worker dies."""
        while self._thread.is_alive():
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread.is_alive():
            # A step still running (the one planned behind the last, say) is waited for a
            # little: the process must not exit under it (native code mid-step aborts the
            # process: "terminate called without an active exception"). A wedged one is left
            # after that wait, so the process can still exit.
            timeout = STOP_WAIT_BUSY_S if self.busy else 10.0
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)


def _deliver(outbox: asyncio.Queue, result: StepResult) -> None:
    """On the loop: a result into the batcher's inbox. The inbox is sized for it; should it be
    full anyway, wait for room rather than lose the result (the batcher would stall)."""
    try:
        outbox.put_nowait(result)
    except asyncio.QueueFull:
        log.error("batcher inbox full: step %d's result waits for room", result.step_id)
        asyncio.get_running_loop().create_task(outbox.put(result))


class _Handoff:
    """The executor's inbox: ``put_nowait((model, plan))`` hands the plan to the worker
    thread at once. Each batcher keeps at most two steps in flight, so it never grows."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    def put_nowait(self, item: tuple[str, StepPlan]) -> None:
        self._executor._submit(*item)


def _settle(done: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if not done.done():
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)


def _needs_host_tokens(plan: StepPlan) -> bool:
    """A sequence whose logits processing reads its output so far (penalties, a grammar):
    the previous step's token must be known on the host first."""
    return any(s.output_ids and s.output_ids[-1] == PLACEHOLDER for s in plan.seqs)


def _done(step: _InFlight) -> bool:
    """Its tokens are on the host (a runner that hands back the StepResult at launch: done)."""
    return isinstance(step.launched, StepResult) or step.launched.ready()
