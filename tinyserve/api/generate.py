"""The one generate path: a parsed request (a Job) becomes 1..N requests to the engine, n
choices per prompt (several prompts: a completions batch), answered as one response, streamed
(SSE) or whole. A single request is the batch of one.

    handles --Submit--> admission (all sent before any answer is awaited, so they are admitted
    together and start in the same step) -> each Accepted or Failed -> outputs merged as they
    come, tagged with their choice -> the shaper's chunks (SSE) or its one body

With n > 1 the batcher holds choices 1..n-1 until choice 0 has its first token, so they find
its prompt in the prefix cache (one prefill). If any choice is refused the others are aborted
and the whole request gets that error. However the handler ends, each handle is closed:
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

from tinyserve.actors.admission import too_many
from tinyserve.actors.lanes import RequestHandle
from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.api.access_log import ACCESS, AccessInfo
from tinyserve.api.context import CLIENT_ID, ApiContext, Serving
from tinyserve.api.errors import ApiError
from tinyserve.api.sampling import MAX_N, choice_params
from tinyserve.api.shaping import Shaper, logprob_entries
from tinyserve.api.sse import OFF_LOOP_LOGPROBS, stream
from tinyserve.config import TenantConfig
from tinyserve.core.adapters import AdapterSpec
from tinyserve.messages import AdmissionRejected, Failed, Output, SamplingParams, Submit

MAX_BATCH = 64  # outputs one stream write may carry (a reader far behind catches up in steps)

Merged = AsyncIterator[list[tuple[int, Output]]]


@dataclass(slots=True)
class Job:
    """A validated generate request, ready to submit."""

    prompts: list[list[int]]  # token ids, one list per prompt
    params: SamplingParams
    n: int  # choices per prompt
    tenant: TenantConfig
    model: str  # the served model it was routed to
    stream: bool
    shaper: Callable[[str, int], Shaper]  # (answering model, choices) -> the response's shaper
    adapter: AdapterSpec | None = None  # the LoRA adapter it runs with (None: the base model)


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
        ids_of = [ids for ids in job.prompts for _ in range(job.n)]
        if len(ids_of) > 1:
            _check_batch(serving, job, len(ids_of))
        replies = job.params.max_tokens + 8  # every Output it can get, an Accepted, a Failed
        handles = [RequestHandle(next(self._ids), ReplyQueue(maxsize=replies))
                   for _ in ids_of]
        access = request.get(ACCESS)  # the first handle's outputs fill in its line
        if access is not None:
            access.id, access.model, access.stream = handles[0].request_id, job.model, job.stream
            access.prompt_tokens = sum(len(p) for p in job.prompts)
        for h in handles:
            self._live[h.request_id] = h
        registry = serving.adapters.get(job.model) if job.adapter is not None else None
        if registry is not None:  # an unload waits until no request uses the adapter
            registry.acquire(job.adapter.name)
        try:
            for i, h in enumerate(handles):
                first = i - i % job.n
                self._submit(serving, job, h, ids_of[i], choice_params(job.params, i % job.n),
                             job.n if i == first else 0,
                             None if i == first else handles[first].request_id)
            for i, h in enumerate(handles):  # (the access line names the first's model)
                await self._decided(h, access if i == 0 else None)
            # an adapter answers as itself (as vLLM names it); it never leaves its base
            answering = job.adapter.name if job.adapter is not None else handles[0].lane.name
            shaper = job.shaper(answering, len(handles))
            outputs = _merged([self._outputs(h, access if i == 0 else None, i)
                               for i, h in enumerate(handles)])
            if job.stream:
                return await stream(request, outputs, shaper, {
                    "X-Request-Id": request[CLIENT_ID], "X-Tinyserve-Model": answering},
                    access, self._ctx.count_error)
            return await _whole(outputs, shaper, len(handles), answering)
        finally:
            if access is not None:
                access.completion_tokens = sum(h.generated for h in handles)
            for h in handles:
                del self._live[h.request_id]
                h.close()
            if registry is not None:
                registry.release(job.adapter.name)

    def _submit(self, serving: Serving, job: Job, h: RequestHandle, prompt_ids: list[int],
                params: SamplingParams, n: int, after: int | None) -> None:
        t = job.tenant
        msg = Submit(h.request_id, tuple(prompt_ids), params, time.monotonic(), h,
                     t.cache_salt, t.name, t.priority, job.model, n=n, after=after,
                     adapter=job.adapter)
        try:
            serving.admission.inbox.put_nowait(msg)
        except asyncio.QueueFull:  # capacity requests are already ahead of this one
            h.done = True
            serving.metrics.emit(AdmissionRejected(t.name, "capacity", job.model))
            raise ApiError.from_failed(too_many(serving.admission.capacity)) from None

    @staticmethod
    async def _decided(h: RequestHandle, access: AccessInfo | None) -> None:
        """Admission's answer to a submitted request: accepted (admission set its lane), or
        an ApiError."""
        first = await h.replies.get()
        if isinstance(first, Failed):
            h.done = True
            raise ApiError.from_failed(first)
        if access is not None and h.lane is not None:
            access.model = h.lane.name

    @staticmethod
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


def _note(access: AccessInfo | None, h: RequestHandle, last: Output) -> None:
    """The access line, once a batch of Outputs: its last one says where the request stands."""
    if access is not None:
        access.completion_tokens = h.generated
        access.first_output = access.first_output or time.monotonic()
        access.finish_reason = last.finish_reason


def _check_batch(serving: Serving, job: Job, choices: int) -> None:
    """A batch no wait could ever admit is a 400, not a 429 to retry forever: more choices
    than the tenant may run at once or the model may hold, or more tokens than the tenant's
    per-minute budget."""
    if choices > MAX_N:
        raise ApiError(400, f"n: {len(job.prompts)} prompts x n={job.n} is more than {MAX_N} "
                       "choices per request", param="n")
    tenant = job.tenant
    limits = [(tenant.max_concurrent, "the tenant's max_concurrent"),
              (serving.admission.lanes[job.model].capacity, "the model's capacity")]
    for limit, what in limits:
        if limit is not None and choices > limit:
            if job.n > 1:  # the choices of n, not (only) the prompts, are what exceeds it
                raise ApiError(400, f"n: {len(job.prompts)} prompt(s) x n={job.n} is "
                               f"{choices} choices, more than {what} ({limit}); ask for fewer",
                               param="n")
            raise ApiError(400, f"prompt: a batch of {choices} prompts is more than {what} "
                           f"({limit}); send fewer at once", param="prompt")
    cost = sum(len(p) for p in job.prompts) * job.n + choices * job.params.max_tokens
    if tenant.tokens_per_minute is not None and cost > tenant.tokens_per_minute:
        if job.n > 1:
            raise ApiError(400, f"n: {len(job.prompts)} prompt(s) x n={job.n} may use {cost} "
                           f"tokens, more than the tenant's {tenant.tokens_per_minute} per "
                           "minute; ask for fewer", param="n")
        raise ApiError(400, f"prompt: the batch may use {cost} tokens, more than the "
                       f"tenant's {tenant.tokens_per_minute} per minute", param="prompt")


def check_before_compile(serving: Serving, job: Job) -> None:
    """The admission checks that need no compiled grammar, run before compiling one, so a
    tenant throttled or over its limits costs the server no compile (a 30,000-value
    guided_choice: ~0.1-1 s and tens of MB): a batch's limits (as ``run`` checks them), then
    the tenant's quota as it stands now for the first choice (admission's own check, counted
    as its refusals are; it checks each choice again when it arrives)."""
    choices = len(job.prompts) * job.n
    if choices > 1:
        _check_batch(serving, job, choices)
    if job.prompts:
        refusal = serving.admission.refuse_before_compile(
            job.tenant.name, job.model, len(job.prompts[0]), job.params.max_tokens)
        if refusal is not None:
            raise ApiError.from_failed(refusal)


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


async def _whole(outputs: Merged, shaper: Shaper, choices: int, answering: str
                 ) -> web.Response:
    """One JSON body: shaped off the loop when it is large (several choices, or many logprob
    entries)."""
    per_choice: list[list[Output]] = [[] for _ in range(choices)]
    async with contextlib.aclosing(outputs):
        async for batch in outputs:
            for i, out in batch:
                per_choice[i].append(out)
    if choices > 1 or logprob_entries(per_choice[0]) > OFF_LOOP_LOGPROBS:
        body = await asyncio.get_running_loop().run_in_executor(
            None, lambda: msgspec.json.encode(shaper.body_many(per_choice)))
    else:
        body = msgspec.json.encode(shaper.body_many(per_choice))
    return web.Response(body=body, content_type="application/json",
                        headers={"X-Tinyserve-Model": answering})
