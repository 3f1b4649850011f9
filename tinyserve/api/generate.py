"""The one generate path: a prepared request (a Job) becomes 1..N requests to the engine, n
choices per prompt (several prompts: a completions batch), answered as one response, streamed
(SSE) or whole. A single request is the batch of one.

    handles -> admission.ask (one decision for every choice: admitted together, so they start
    in the same step, or refused together) -> outputs merged as they come, tagged with their
    choice -> the shaper's chunks (SSE), or the fold of those chunks (the whole answer)

With n > 1 the batcher holds choices 1..n-1 until choice 0 has its first token, so they find
its prompt in the prefix cache (one prefill). However the handler ends, each handle is closed:
aborted if it may still run, its slot and unused tokens released. ``fail_all`` answers every
live request at once (the supervisor's last resort, or a model that went down).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from tinyserve.actors.lanes import RequestHandle
from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.api.access_log import ACCESS, AccessInfo
from tinyserve.api.context import CLIENT_ID, ApiContext
from tinyserve.api.errors import ApiError
from tinyserve.api.prepare import Prepared
from tinyserve.api.sampling import check_choices, choice_params
from tinyserve.api.shaper import Shaper, logprob_entries, whole
from tinyserve.api.sse import OFF_LOOP_LOGPROBS, stream
from tinyserve.config import TenantConfig
from tinyserve.messages import Failed, Output, Submit

MAX_BATCH = 64  # outputs one stream write may carry (a reader far behind catches up in steps)

Merged = AsyncIterator[list[tuple[int, Output]]]
# (answering model, choices, whole) -> the response's shaper
ShaperFactory = Callable[[str, int, bool], Shaper]


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A prepared request, ready to submit."""

    prepared: Prepared
    n: int  # choices per prompt
    tenant: TenantConfig
    stream: bool
    shaper: ShaperFactory


class Generator:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self._ids = itertools.count(1)  # the server's request ids (0 is the warm-up's)
        self._live: dict[int, RequestHandle] = {}  # requests with a handler waiting on them

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def run(self, request: web.Request, job: Job) -> web.StreamResponse:
        serving = self._ctx.serving_or_503()
        p = job.prepared
        check_choices(len(p.prompts), job.n)
        replies = p.params.max_tokens + 8  # every Output it can get, a Failed, and room
        handles = [RequestHandle(next(self._ids), ReplyQueue(maxsize=replies))
                   for _ in range(len(p.prompts) * job.n)]
        access = request.get(ACCESS)  # the first handle's outputs fill in its line
        if access is not None:
            access.id, access.model, access.stream = handles[0].request_id, p.model, job.stream
            access.prompt_tokens = sum(len(ids) for ids in p.prompts)
        for h in handles:
            self._live[h.request_id] = h
        registry = serving.adapters.get(p.model) if p.adapter is not None else None
        if registry is not None:  # an unload waits until no request uses the adapter
            registry.acquire(p.adapter.name)
        try:
            decision = await serving.admission.ask(_submits(job, handles))
            if isinstance(decision, Failed):
                for h in handles:
                    h.done = True
                raise ApiError.from_failed(decision)
            # an adapter answers as itself (as vLLM names it); it never leaves its base
            answering = p.adapter.name if p.adapter is not None else decision.model
            if access is not None:
                access.model = decision.model
            outputs = _merged([_outputs(h, access if i == 0 else None, i)
                               for i, h in enumerate(handles)])
            if job.stream:
                return await stream(request, outputs, job.shaper(answering, len(handles), False),
                                    {"X-Request-Id": request[CLIENT_ID],
                                     "X-Tinyserve-Model": answering},
                                    access, self._ctx.count_error)
            return await _whole(outputs, job.shaper(answering, len(handles), True),
                                answering, len(handles))
        finally:
            if access is not None:
                access.completion_tokens = sum(h.generated for h in handles)
            for h in handles:
                del self._live[h.request_id]
                h.close()
            if registry is not None:
                registry.release(p.adapter.name)

    def fail_all(self, status: int, message: str, model: str | None = None) -> None:
        """Answer every live request (of one model, if given) with this error now."""
        failed = Failed(status, message, retry_after=5.0)
        for h in self._live.values():
            if model is not None and (h.lane is None or h.lane.name != model):
                continue  # (one not yet admitted: admission sends it elsewhere or refuses it)
            while True:  # the reader only needs the error: drop output it has not read yet
                try:
                    h.replies.put_nowait(failed)
                    break
                except asyncio.QueueFull:
                    h.replies.get_nowait()
            h.abort()  # (admitted: a live batcher may still run it)


def _submits(job: Job, handles: list[RequestHandle]) -> list[Submit]:
    """One Submit per choice: choice j of each prompt seeded seed + j; the prompt's first
    choice carries n, the others wait for it (``after``)."""
    p, t, n, now = job.prepared, job.tenant, job.n, time.monotonic()
    submits = []
    for i, h in enumerate(handles):
        first = i - i % n
        submits.append(Submit(
            request_id=h.request_id, prompt_token_ids=tuple(p.prompts[i // n]),
            params=choice_params(p.params, i % n), arrival_time=now, handle=h,
            cache_salt=t.cache_salt, tenant=t.name, priority=t.priority, model=p.model,
            n=n if i == first else 0, after=None if i == first else handles[first].request_id,
            adapter=p.adapter))
    return submits


async def _outputs(h: RequestHandle, access: AccessInfo | None, index: int) -> Merged:
    """The request's outputs until the final one, tagged with its choice ``index``, in
    batches: whatever has queued up by the time the reader comes back (a reader that lags
    behind the steps writes several tokens at once, not one write per token). A Failed
    becomes an ApiError."""
    replies = h.replies
    while True:
        msgs = await replies.get_batch(MAX_BATCH)
        outs: list[tuple[int, Output]] = []
        for msg in msgs:
            if isinstance(msg, Failed):
                h.done = True
                if outs:
                    _note(access, h, outs[-1][1])
                    yield outs
                raise ApiError.from_failed(msg)
            h.generated = msg.completion_tokens or h.generated
            outs.append((index, msg))
            if msg.finish_reason is not None:
                break
        _note(access, h, msg)
        if msg.finish_reason is not None:
            h.done = True
            yield outs
            return
        yield outs


def _note(access: AccessInfo | None, h: RequestHandle, last: Output) -> None:
    """The access line, once a batch of Outputs: its last one says where the request stands."""
    if access is not None:
        access.completion_tokens = h.generated
        access.first_output = access.first_output or time.monotonic()
        access.finish_reason = last.finish_reason


def _merged(iters: list[Merged]) -> Merged:
    """Several requests' (tagged) outputs as they come."""
    if len(iters) == 1:  # (no task per read for the common case)
        return iters[0]
    return _interleaved(iters)


async def _interleaved(iters: list[Merged]) -> Merged:
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            got = []
            for fut in done:
                i = pending.pop(fut)
                try:
                    outs = fut.result()
                except StopAsyncIteration:
                    continue
                got.extend(outs)
                pending[asyncio.ensure_future(anext(iters[i]))] = i
            if got:
                yield got
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            await it.aclose()


async def _whole(outputs: Merged, shaper: Shaper, answering: str, choices: int
                 ) -> web.Response:
    """One JSON body, the fold of the stream: shaped off the loop when it is large (several
    choices, or many logprob entries)."""
    got: list[tuple[int, Output]] = []
    async with contextlib.aclosing(outputs):
        async for batch in outputs:
            got.extend(batch)

    def body() -> bytes:
        return msgspec.json.encode(whole(shaper, got))
    if choices > 1 or logprob_entries(o for _, o in got) > OFF_LOOP_LOGPROBS:
        data = await asyncio.get_running_loop().run_in_executor(None, body)
    else:
        data = body()
    return web.Response(body=data, content_type="application/json",
                        headers={"X-Tinyserve-Model": answering})
