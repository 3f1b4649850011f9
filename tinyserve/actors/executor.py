"""Executor actor: runs each StepPlan on the model in a worker thread.

The forward pass runs off the event loop, so /health and new requests are answered while a
step computes. Inbox capacity 1: the batcher keeps at most one step in flight, so a full inbox
would be a bug, not back-pressure. A step that raises becomes a StepResult with ``error`` set;
the actor keeps serving. ``busy_since`` and ``consecutive_failures`` are the snapshots the
supervisor reads to see a wedged device or a failing one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tinyserve.messages import StepPlan, StepResult

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, execute: Callable[[StepPlan], StepResult]) -> None:
        self._execute = execute  # the ModelRunner's execute: owns weights and KV tensors
        self.outbox: asyncio.Queue | None = None  # the batcher's inbox, wired by the server
        self.inbox: asyncio.Queue[StepPlan] = asyncio.Queue(maxsize=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-step")
        self.task: asyncio.Task | None = None
        self.busy_since: float | None = None  # time.monotonic() when the step in flight began
        self.consecutive_failures = 0

    def start(self) -> asyncio.Task:
        self.task = asyncio.get_running_loop().create_task(self.run(), name="executor")
        return self.task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = await self.inbox.get()
            self.busy_since = time.monotonic()
            try:
                result = await loop.run_in_executor(self._pool, self._execute, plan)
                self.consecutive_failures = 0
            except Exception as e:  # a failed step must not take the server down
                log.exception("step %d failed", plan.step_id)
                self.consecutive_failures += 1
                result = StepResult(plan.step_id, (), error=f"{type(e).__name__}: {e}")
            finally:
                self.busy_since = None
            await self.outbox.put(result)

    async def stop(self) -> None:
        wedged = self.busy_since is not None
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        # A wedged step never returns: do not wait for its thread (the process is exiting).
        self._pool.shutdown(wait=not wedged, cancel_futures=True)
