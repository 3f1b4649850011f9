"""ReplyQueue: asyncio.Queue's behaviour for one reader, which the batcher and readers rely on."""

import asyncio

import pytest

from tinyserve.actors.reply_queue import ReplyQueue


def test_bounded_like_asyncio_queue():
    q = ReplyQueue(maxsize=2)
    assert q.empty() and not q.full() and q.qsize() == 0 and q.maxsize == 2
    q.put_nowait("a")
    q.put_nowait("b")
    assert q.full() and q.qsize() == 2
    with pytest.raises(asyncio.QueueFull):
        q.put_nowait("c")
    assert q.get_nowait() == "a" and q.get_nowait() == "b"
    with pytest.raises(asyncio.QueueEmpty):
        q.get_nowait()
    unbounded = ReplyQueue()
    for i in range(1000):
        unbounded.put_nowait(i)
    assert not unbounded.full() and unbounded.qsize() == 1000


def test_a_put_wakes_the_waiting_reader_in_order():
    async def main():
        q = ReplyQueue(maxsize=8)
        got = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not got.done()
        q.put_nowait(1)
        q.put_nowait(2)
        assert await asyncio.wait_for(got, 1) == 1
        assert await q.get() == 2  # (already there: no wait)
        batch = asyncio.ensure_future(q.get_batch(3))
        await asyncio.sleep(0)
        for i in range(5):
            q.put_nowait(i)
        assert await asyncio.wait_for(batch, 1) == [0, 1, 2]  # at most the limit
        assert await q.get_batch(10) == [3, 4]
    asyncio.run(main())


def test_a_cancelled_get_loses_nothing_and_a_second_reader_is_refused():
    async def main():
        q = ReplyQueue()
        first = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        second = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert second.done() and isinstance(second.exception(), RuntimeError)
        first.cancel()
        await asyncio.sleep(0)
        q.put_nowait("kept")  # no reader waits: it stays for the next get
        assert await asyncio.wait_for(q.get(), 1) == "kept"
        # cancelled after the put woke it, before it ran: the item is still there
        late = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait("x")
        late.cancel()
        await asyncio.sleep(0)
        assert late.cancelled()
        assert q.get_nowait() == "x"
    asyncio.run(main())


def test_put_many_is_all_or_nothing_and_wakes_the_reader():
    async def main():
        q = ReplyQueue(maxsize=4)
        got = asyncio.ensure_future(q.get_batch(10))
        await asyncio.sleep(0)
        q.put_many(["a", "b", "c"])
        assert await asyncio.wait_for(got, 1) == ["a", "b", "c"]
        q.put_many(["d", "e"])
        with pytest.raises(asyncio.QueueFull):
            q.put_many(["f", "g", "h"])  # 2 + 3 > 4: none of them is put
        assert q.qsize() == 2
        q.put_many(["f", "g"])  # exactly full is allowed
        assert q.full() and [q.get_nowait() for _ in range(4)] == ["d", "e", "f", "g"]
        q.put_many([])  # nothing to put: no wake-up, no error
        assert q.empty()
    asyncio.run(main())
