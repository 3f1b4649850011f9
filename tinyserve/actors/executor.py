"""Executor actor: runs each StepPlan on the model in a worker thread.

The forward pass runs off the event loop, so /health and new requests are answered while a
step computes. Inbox capacity 1: the batcher keeps at most one step in flight, so a full inbox
would be a bug, not back-pressure. A step that raises becomes a StepResult with ``error`` set;
the actor keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
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
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="executor")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = await self.inbox.get()
            try:
                result = await loop.run_in_executor(self._pool, self._execute, plan)
            except Exception as e:  # a failed step must not take the server down
                log.exception("step %d failed", plan.step_id)
                result = StepResult(plan.step_id, (), error=f"{type(e).__name__}: {e}")
            await self.outbox.put(result)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True)
