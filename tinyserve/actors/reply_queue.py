"""A request's reply queue: bounded, one reader, and cheap per item.

The batcher hands every streamed token's Output to one of these and the request's reader takes
them: at hundreds of streams that is the hottest queue in the server. It keeps asyncio.Queue's
interface for what its two sides use (``put_nowait`` raising QueueFull, ``get``,
``get_nowait`` raising QueueEmpty, ``empty``, ``qsize``, ``full``), so a plain asyncio.Queue
still works in its place (the actor tests use one), and drops what a queue with many readers
and ``join`` needs: a put wakes the one reader's future, if it is waiting, and nothing else.
``get_batch`` takes whatever is there in one call (a reader behind the steps takes several
tokens' Outputs at once).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class ReplyQueue:
    __slots__ = ("_items", "_maxsize", "_waiter")

    def __init__(self, maxsize: int = 0) -> None:
        self._items: deque = deque()
        self._maxsize = maxsize  # 0: unbounded
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits

    @property
    def maxsize(self) -> int:
        return self._maxsize

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self._maxsize <= len(self._items)

    def put_nowait(self, item: Any) -> None:
        if 0 < self._maxsize <= len(self._items):
            raise asyncio.QueueFull
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (cancelled: the reader's get has gone; the item stays)
                waiter.set_result(None)

    def put_many(self, items: list) -> None:
        """``put_nowait`` each, in order, in one call; QueueFull if not all fit (none is put)."""
        if 0 < self._maxsize < len(self._items) + len(items):
            raise asyncio.QueueFull
        self._items.extend(items)
        waiter = self._waiter
        if waiter is not None and items:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            await self._wait()
        return self._items.popleft()

    async def get_batch(self, limit: int) -> list:
        """The items waiting, oldest first, at most ``limit`` (>= 1) of them; waits for one."""
        items = self._items
        while not items:
            await self._wait()
        if len(items) == 1:
            return [items.popleft()]
        return [items.popleft() for _ in range(min(limit, len(items)))]

    async def _wait(self) -> None:
        if self._waiter is not None:
            raise RuntimeError("a ReplyQueue has one reader; a second get() is waiting on it")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # (cancelled before a put woke it)
                self._waiter = None
