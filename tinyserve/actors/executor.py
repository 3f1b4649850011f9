"""Executor actor: runs each StepPlan on its model in a worker thread.

The forward pass runs off the event loop, so /health and new requests are answered while a
step computes. The inbox takes (model name, StepPlan); each model's batcher keeps at most one
step in flight, so the inbox (one slot per model) is never full, and taking steps in arrival
order runs the models in turn: a model whose step just ran queues its next one behind the
others' (round robin over the models with work, one step each). A step that raises becomes a
StepResult with ``error`` set; the actor keeps serving. ``busy_since`` and ``failures``
(consecutive failed steps per model) are the snapshots the supervisor reads to see a wedged
device or a failing model.

The worker is one daemon thread, not a ThreadPoolExecutor: a wedged step never returns, and
the interpreter joins pool threads at exit, so a wedged pool thread would keep the process
(that the orchestrator is trying to restart) alive forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from tinyserve.messages import StepPlan, StepResult

log = logging.getLogger(__name__)

_STOP = None  # tells the worker thread to end


class Executor:
    def __init__(self, runners: dict[str, Callable[[StepPlan], StepResult]]) -> None:
        # Each model's ModelRunner.execute: owns that model's weights and KV tensors.
        self.runners = runners
        self.outboxes: dict[str, asyncio.Queue] = {}  # each model's batcher inbox (the server's)
        self.inbox: asyncio.Queue[tuple[str, StepPlan]] = asyncio.Queue(maxsize=len(runners))
        self.task: asyncio.Task | None = None
        # Set and cleared by the worker thread itself, so cancelling the task cannot hide a
        # step that is still running.
        self.busy_since: float | None = None  # time.monotonic() when the running step began
        self.failures = dict.fromkeys(runners, 0)  # consecutive failed steps, per model
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name="tinyserve-step", daemon=True)

    def start(self) -> asyncio.Task:
        self._thread.start()
        self.task = asyncio.get_running_loop().create_task(self.run(), name="executor")
        return self.task

    @property
    def busy(self) -> bool:
        return self.busy_since is not None

    def _worker(self) -> None:
        while (job := self._work.get()) is not _STOP:
            model, plan, loop, done = job
            self.busy_since = time.monotonic()
            try:
                result = self.runners[model](plan)
                self.failures[model] = 0
            except Exception as e:  # a failed step must not take the server down
                log.exception("%s: step %d failed", model, plan.step_id)
                self.failures[model] += 1
                result = StepResult(plan.step_id, (), error=f"{type(e).__name__}: {e}")
            finally:
                self.busy_since = None
            loop.call_soon_threadsafe(_resolve, done, result)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            model, plan = await self.inbox.get()
            done = loop.create_future()
            self._work.put((model, plan, loop, done))
            await self.outboxes[model].put(await done)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self._work.put(_STOP)
        if self._thread.is_alive() and not self.busy:  # a busy thread may be wedged: leave it
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)


def _resolve(done: asyncio.Future, result: StepResult) -> None:
    if not done.cancelled():
        done.set_result(result)
