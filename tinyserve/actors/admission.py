"""Admission actor: decides, per request, whether the engine takes it now.

Rules, in order: the server is unhealthy, not ready or draining -> 503; the engine already
holds max_num_seqs + max_waiting requests -> 429 with Retry-After; else the Submit goes on to
the batcher, and only then is the request told Accepted (so an Abort that ingress sends after
Accepted can never overtake its Submit).

Inbox capacity: ``capacity`` (max_num_seqs + max_waiting). Ingress puts without waiting; a
full inbox means at least ``capacity`` requests are already ahead of this one, so ingress
answers 429 + Retry-After right there, exactly as this actor would. Below capacity nobody is
turned away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tinyserve.messages import Accepted, Failed, Submit

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


def too_many(capacity: int) -> Failed:
    return Failed(429, f"too many requests: {capacity} are already queued or running",
                  retry_after=RETRY_AFTER_S)


class Admission:
    def __init__(self, batcher_inbox: asyncio.Queue, batcher_counts: Callable[[], tuple[int, int]],
                 capacity: int, unhealthy: Callable[[], str | None] = lambda: None) -> None:
        self._batcher_inbox = batcher_inbox
        # (requests the batcher holds, Submits it has taken from its inbox): a snapshot, the
        # batcher owns both
        self._batcher_counts = batcher_counts
        self._unhealthy = unhealthy  # the supervisor's verdict: None, or why not
        self.capacity = capacity
        self.inbox: asyncio.Queue[Submit] = asyncio.Queue(maxsize=capacity)
        self.ready = False  # set once the model is loaded and warmed up
        self.draining = False  # set on SIGTERM
        self.num_admitted = 0

    def in_system(self) -> int:
        """Requests the batcher holds plus the Submits still on their way to it."""
        held, received = self._batcher_counts()
        return held + self.num_admitted - received

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                self._admit(msg)
            except Exception:  # never lose a request silently: answer it
                log.exception("admission failed for request %d", msg.request_id)
                msg.reply_to.put_nowait(Failed(500, "admission failed"))

    def _admit(self, msg: Submit) -> None:
        fault = self._unhealthy()
        if fault or self.draining or not (self.ready or msg.internal):  # warm-up: before ready
            why = (f"the server is unhealthy: {fault}" if fault else
                   "the server is shutting down" if self.draining else "the model is not ready")
            msg.reply_to.put_nowait(Failed(503, why, retry_after=5.0))
            return
        if self.in_system() >= self.capacity:
            msg.reply_to.put_nowait(too_many(self.capacity))
            return
        self._batcher_inbox.put_nowait(msg)  # sized for capacity: never full (see batcher)
        self.num_admitted += 1
        msg.reply_to.put_nowait(Accepted())
