"""Supervisor: notices when the server can no longer serve, says so, and answers the waiting.

Faults it watches for:
- an actor task that ends (crash, or a return that should never happen);
- a step in flight longer than ``step_timeout_s`` (a wedged GPU: the thread cannot be killed);
- ``max_failed_steps`` consecutive failed steps of a model (a broken device fails every step).

A failing model, while others still serve, is only marked down (``down``; ``on_model_down``
runs once for it): its pending requests are answered, its degradable traffic goes to its
fallback, the rest gets 503, and the server probes it with a request of its own now and then
(``up`` when one succeeds). The last model going down, like the other faults, is fatal:
``failure`` is set (``/health`` then answers 503, so the orchestrator restarts the process,
and admission turns new requests away with 503), and ``on_fatal`` runs once, which fails every
pending request with a 503 instead of leaving it to hang. Recovery is a restart: after a crash
or a wedged step, the state on the other side cannot be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tinyserve.actors.executor import Executor

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, executor: Executor, on_fatal: Callable[[str], None],
                 step_timeout_s: float = 60.0, max_failed_steps: int = 3,
                 on_model_down: Callable[[str, str], None] = lambda model, reason: None) -> None:
        self._executor = executor
        self._on_fatal = on_fatal
        self._on_model_down = on_model_down
        self.down: dict[str, str] = {}  # model -> why it no longer serves
        self.step_timeout_s = step_timeout_s
        self.max_failed_steps = max_failed_steps
        self.failure: str | None = None
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    def watch(self, task: asyncio.Task) -> None:
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        self.fail(f"actor {task.get_name()} stopped: {exc!r}" if exc else
                  f"actor {task.get_name()} stopped")

    def fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.critical("server unhealthy: %s; failing every pending request", reason)
        try:
            self._on_fatal(reason)
        except Exception:
            log.exception("supervisor: failing the pending requests raised")

    def up(self, model: str) -> None:
        """A model that was down ran a step again (the server's probe): count it as serving."""
        if self.down.pop(model, None) is not None:
            log.warning("model %s is back up", model)

    async def run(self) -> None:
        """Check the step in flight often enough to see a timeout within a second of it."""
        period = min(0.25, self.step_timeout_s / 4)
        while self.failure is None:
            await asyncio.sleep(period)
            self.check()

    def check(self) -> None:
        ex = self._executor
        since = ex.busy_since
        if since is not None and time.monotonic() - since > self.step_timeout_s:
            self.fail(f"a step has run for over {self.step_timeout_s:g}s (wedged device?)")
            return
        for model, failures in ex.failures.items():
            if failures >= self.max_failed_steps and model not in self.down:
                reason = f"{failures} consecutive steps failed"
                if len(self.down) + 1 == len(ex.failures):  # the last one serving
                    label = "" if len(ex.failures) == 1 else f" (model {model}, the last serving)"
                    self.fail(reason + label)
                    return
                self.down[model] = reason
                log.error("model %s is down: %s; its traffic goes to its fallback or gets 503",
                          model, reason)
                try:
                    self._on_model_down(model, reason)
                except Exception:
                    log.exception("supervisor: taking model %s down raised", model)

    async def stop(self) -> None:
        """Cancel the watched tasks (a deliberate stop is not a fault)."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
