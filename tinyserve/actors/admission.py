"""Admission actor: decides, per request, whether the engine takes it now.

Rules, in order: not ready or draining -> 503; the engine already holds max_num_seqs +
max_waiting requests -> 429 with Retry-After; else the Submit goes on to the batcher. The
reply goes on the request's own queue (Accepted or Rejected) before anything else.

Inbox capacity: ``inbox_size``. Ingress puts without waiting; a full inbox is back-pressure,
answered with 503 + Retry-After right there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tinyserve.messages import Accepted, Rejected, Submit

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, batcher_inbox: asyncio.Queue, load: Callable[[], int], capacity: int,
                 inbox_size: int = 128) -> None:
        self._batcher_inbox = batcher_inbox
        self._load = load  # requests the batcher holds (a snapshot; the batcher owns them)
        self.capacity = capacity
        self.inbox: asyncio.Queue[Submit] = asyncio.Queue(maxsize=inbox_size)
        self.ready = False  # set once the model is loaded and warmed up
        self.draining = False  # set on SIGTERM

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                await self._admit(msg)
            except Exception:  # never lose a request silently: answer it
                log.exception("admission failed for %s", msg.request_id)
                msg.reply_to.put_nowait(Rejected(500, "admission failed"))

    async def _admit(self, msg: Submit) -> None:
        if self.draining or not self.ready:
            why = "the server is shutting down" if self.draining else "the model is not ready"
            msg.reply_to.put_nowait(Rejected(503, why, retry_after=5.0))
            return
        if self._load() + self._batcher_inbox.qsize() >= self.capacity:
            msg.reply_to.put_nowait(Rejected(
                429, f"too many requests: {self.capacity} are already queued or running",
                retry_after=1.0))
            return
        msg.reply_to.put_nowait(Accepted())
        await self._batcher_inbox.put(msg)
