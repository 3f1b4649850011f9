"""Ingress: the aiohttp front end (OpenAI-compatible API, probes, metrics, OpenAPI).

One generate path serves both APIs:

    auth -> decode -> route (``model`` names a served model or a --route alias; 404 if neither)
    -> parse with that model's tokenizer: bound every field, prompt ids, sampling params
    (``prompts.py``; 400 naming the field) -> submit (admission answers Accepted, naming the
    model that will answer, or 429/503) -> stream SSE, or collect one body; the answering
    model is in the body's ``model`` and the ``X-Tinyserve-Model`` header

What the answer says is the Shaper's business (``responses.py``); this file moves bytes. Each
request gets the server's own id; the client's ``X-Request-Id`` is only echoed and logged.
A request whose client leaves (the handler is cancelled, or a write fails) is aborted wherever
it is: before admission decides, an orphan task waits for the decision and aborts it if it was
accepted; after, an Abort goes straight to the batcher (it cannot overtake the Submit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from tinyserve import access_log
from tinyserve.actors.admission import Lane, too_many
from tinyserve.actors.endpoints import Backend, InfoEndpoints, json_response
from tinyserve.config import ServerConfig, TenantConfig
from tinyserve.messages import (
    Abort,
    Accepted,
    AdmissionRejected,
    Failed,
    Output,
    RequestFailed,
    SamplingParams,
    Submit,
)
from tinyserve.prompts import PromptParser
from tinyserve.protocol import (
    MAX_N,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from tinyserve.responses import ChatShaper, CompletionShaper
from tinyserve.tools import ToolPlan

log = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CLIENT_ID = web.RequestKey("client_id", str)  # X-Request-Id: echoed and logged, never a key
ACCESS = web.RequestKey("access", access_log.AccessInfo)  # the access line's fields
OFF_LOOP_LOGPROBS = 256  # whole bodies with more logprob entries are shaped in a worker thread
MAX_PARSING = 64  # requests reading / checking / tokenizing at once; the rest wait their turn
WRITE_TIMEOUT_S = 30.0  # a streaming client that reads nothing for this long has gone
MAX_BATCH = 64  # outputs one stream write may carry (a reader far behind catches up in steps)


@dataclass(slots=True, eq=False)
class _Call:
    """One request as ingress sees it: its reply queue and how far it got."""

    rid: int
    replies: asyncio.Queue
    tenant: str
    lane: Lane | None = None  # the model answering it, once accepted
    access: access_log.AccessInfo | None = None  # the access-log line's fields (--access-log)
    generated: int = 0  # completion tokens seen so far (admission refunds the rest)
    accepted: bool = False  # admission forwarded it to the batcher
    done: bool = False  # its final message (an Output with finish_reason, or Failed) arrived


class Ingress(InfoEndpoints):
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.backend: Backend | None = None
        self._ids = itertools.count(1)  # the server's request ids (0 is the warm-up's)
        self._live: dict[int, _Call] = {}  # requests with a handler waiting on them
        self._orphans: set[asyncio.Task] = set()  # aborts waiting for admission's decision
        # Bounds the work (and body memory) before admission: waiting handlers hold only
        # their socket, since aiohttp reads a body when asked to.
        self._parsing = asyncio.Semaphore(MAX_PARSING)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def app(self) -> web.Application:
        middlewares = [self._request_id_mw, self._error_mw]
        if self.cfg.access_log:
            middlewares.insert(0, self._access_mw)  # outermost: sees the status finally sent
        app = web.Application(middlewares=middlewares, client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/admin/routes", self.get_routes)
        app.router.add_post("/admin/routes", self.set_routes)
        return app

    # -- middleware ----------------------------------------------------------------------------
    @web.middleware
    async def _access_mw(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not request.path.startswith(access_log.LOGGED_PREFIXES):
            return await handler(request)
        info = request[ACCESS] = access_log.AccessInfo(time.monotonic())
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = access_log.CLIENT_GONE
            raise
        finally:
            access_log.write(info, request.method, request.path, status, request.get(CLIENT_ID))

    @web.middleware
    async def _request_id_mw(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        given = request.headers.get("X-Request-Id", "")
        request[CLIENT_ID] = given if _REQUEST_ID_OK.match(given) else uuid.uuid4().hex
        resp = await handler(request)
        if not resp.prepared:
            resp.headers["X-Request-Id"] = request[CLIENT_ID]
        return resp

    @web.middleware
    async def _error_mw(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return self._error_response(e)
        except web.HTTPException as e:  # 404/405/413 from aiohttp, in the OpenAI envelope
            if e.status >= 400:
                return self._error_response(ApiError(e.status, e.reason or "error"))
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s (X-Request-Id %s)", request.method,
                          request.path, request.get(CLIENT_ID))
            return self._error_response(ApiError(500, "internal server error"))

    def _error_response(self, e: ApiError) -> web.Response:
        self._count_error(e)
        resp = web.Response(body=e.body(), status=e.status, content_type="application/json")
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, round(e.retry_after)))
        return resp

    def _count_error(self, e: ApiError) -> None:
        if self.backend is not None:
            self.backend.metrics.emit(RequestFailed(str(e.status)))

    # -- probes, metrics, models ---------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 503 once the supervisor has seen a fault only a restart can cure."""
        failure = self.backend.supervisor.failure if self.backend else None
        if failure:
            return json_response({"status": "unhealthy", "reason": failure}, 503)
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness, with the degradation status: 200 while serving (``ready`` or
        ``degraded``, with the worst level and why, and each model's own)."""
        b = self.backend
        if b is None or not b.admission.ready:
            return json_response({"status": "loading"}, 503)
        if b.supervisor.failure:
            return json_response({"status": "unhealthy", "reason": b.supervisor.failure}, 503)
        if b.admission.draining:
            return json_response({"status": "draining"}, 503)
        models, reasons, level = {}, [], 0
        for lane in b.admission.lanes.values():
            slo = lane.slo
            if lane.down:
                status, why = "down", lane.down
            else:
                status, why = ("degraded" if slo.level else "ready"), slo.reason
            models[lane.name] = {"status": status, "level": slo.level, "reason": why}
            if status != "ready":
                level = max(level, slo.level)
                many = len(b.admission.lanes) > 1
                reasons.append(f"{lane.name}: {status}, {why}" if many else why)
        status = "degraded" if reasons else "ready"  # still serving: ready, but say how
        return json_response({"status": status, "level": level, "reason": "; ".join(reasons),
                      "down": [n for n, m in models.items() if m["status"] == "down"],
                      "models": models})

    async def metrics(self, request: web.Request) -> web.Response:
        b = self._backend()
        return web.Response(body=b.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- the generate path -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ChatCompletionRequest)

    async def _generate(self, request: web.Request, kind: type) -> web.StreamResponse:
        tenant = self._auth(request)
        access = request.get(ACCESS)
        b = self._backend()
        if b.supervisor.failure:
            raise ApiError(503, f"the server is unhealthy: {b.supervisor.failure}",
                           retry_after=5.0)
        async with self._parsing:
            req = decode_request(await self._body(request), kind)
            # Sticky per user within a tenant, else per tenant: one user sees one version.
            model = b.router.resolve(req.model, f"{tenant.name}\0{req.user or ''}", {
                n for n, lane in b.admission.lanes.items() if lane.down})
            if model is None:
                raise ApiError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found")
            parser = b.parsers[model]
            prompts, params, tools = await parser.prepare(req)
        chat = isinstance(req, ChatCompletionRequest)
        if chat and req.stream and req.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is not supported with stream in chat "
                           "completions", param="prompt_logprobs", code="unsupported_parameter")
        echo = None
        if not chat and req.echo:  # the prompt as sent (a string), or its ids decoded
            cut = req.truncate_prompt_tokens is not None  # (the ids are what ran)
            echo = [(p if isinstance(p, str) and not cut else parser.tokenizer.decode(ids), ids)
                    for p, ids in zip(_prompt_list(req.prompt), prompts, strict=True)]
        if len(prompts) * req.n > 1:
            return await self._generate_batch(request, req, b, parser, prompts, params, tenant,
                                              model, echo, tools)
        prompt_ids = prompts[0]
        call = _Call(next(self._ids), asyncio.Queue(maxsize=params.max_tokens + 8), tenant.name,
                     access=access)
        if access is not None:
            access.id, access.model, access.stream = call.rid, model, req.stream
            access.prompt_tokens = len(prompt_ids)
        self._live[call.rid] = call
        try:
            await self._submit(b, call, prompt_ids, params, tenant, model)
            answering = call.lane.name
            shaper = self._shaper(req, answering, parser, params, 1, echo, tools)
            if req.stream:
                return await self._stream(request, _indexed(self._outputs(call)), shaper,
                                          answering, call.access)
            outs = []
            async with contextlib.aclosing(self._outputs(call)) as outputs:
                async for batch in outputs:
                    outs.extend(batch)
            if _logprob_entries(outs) > OFF_LOOP_LOGPROBS:
                body = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: msgspec.json.encode(shaper.body(outs)))
            else:
                body = msgspec.json.encode(shaper.body(outs))
            return web.Response(body=body, content_type="application/json",
                                headers={"X-Tinyserve-Model": answering})
        finally:
            del self._live[call.rid]
            if not call.done:
                self._abort(b, call)
            if call.accepted:
                b.admission.release(call.rid, call.generated)

    @staticmethod
    def _shaper(req: ChatCompletionRequest | CompletionRequest, answering: str,
                parser: PromptParser, params: SamplingParams, choices: int,
                echo: list | None, tools: ToolPlan | None) -> ChatShaper | CompletionShaper:
        want = params.logprobs is not None
        if isinstance(req, ChatCompletionRequest):
            return ChatShaper(req, answering, parser.tokenizer, want, choices=choices,
                              tools=tools)
        return CompletionShaper(req, answering, parser.tokenizer, want, choices=choices,
                                echo=echo)

    async def _generate_batch(self, request: web.Request,
                              req: ChatCompletionRequest | CompletionRequest, b: Backend,
                              parser: PromptParser, prompts: list[list[int]],
                              params: SamplingParams, tenant: TenantConfig, model: str,
                              echo: list | None, tools: ToolPlan | None
                              ) -> web.StreamResponse:
        """Several choices: n per prompt (several prompts: a completions batch). One request
        each, answered as one response with a choice each (choice i answers prompt i // n).
        All are sent and admitted together; with n > 1 the batcher holds the other choices
        until their first has its first token, so they find its prompt in the prefix cache
        (one prefill; each recomputes at most the prompt's last partial block).
        If any is refused, the others are aborted and the whole request gets that error. (A
        degradable tenant's choices may spill to a fallback model one by one; the response
        names the model that answered the first.)"""
        n = req.n
        if len(prompts) * n > MAX_N:
            raise ApiError(400, f"n: {len(prompts)} prompts x n={n} is more than {MAX_N} "
                           "choices per request", param="n")
        ids_of = [ids for ids in prompts for _ in range(n)]
        params_of = [_choice_params(params, j) for _ in prompts for j in range(n)]
        self._batch_fits(b, ids_of, params, tenant, model)
        access = request.get(ACCESS)
        # The first call carries the access line's model, first output and finish reason.
        calls = [_Call(next(self._ids), asyncio.Queue(maxsize=params.max_tokens + 8),
                       tenant.name, access=access if i == 0 else None)
                 for i in range(len(ids_of))]
        if access is not None:
            access.id, access.model, access.stream = calls[0].rid, model, req.stream
            access.prompt_tokens = sum(len(p) for p in prompts)
        for call in calls:
            call.done = True  # until sent: nothing to abort
            self._live[call.rid] = call
        try:
            # All sent before any answer is awaited, so they are admitted together and start
            # in the same step (later choices: once their first has its first token).
            for i, call in enumerate(calls):
                call.done = False
                first = i - i % n
                self._send(b, call, ids_of[i], params_of[i], tenant, model,
                           n if i == first else 0, None if i == first else calls[first].rid)
            for call in calls:
                await self._decided(b, call)
            answering = calls[0].lane.name
            shaper = self._shaper(req, answering, parser, params, len(calls), echo, tools)
            if req.stream:
                return await self._stream(request, self._merged(calls), shaper, answering,
                                          access)
            per_choice: list[list[Output]] = [[] for _ in calls]
            async with contextlib.aclosing(self._merged(calls)) as outputs:
                async for batch in outputs:
                    for i, out in batch:
                        per_choice[i].append(out)
            body = await asyncio.get_running_loop().run_in_executor(
                None, lambda: msgspec.json.encode(shaper.body_many(per_choice)))
            return web.Response(body=body, content_type="application/json",
                                headers={"X-Tinyserve-Model": answering})
        finally:
            if access is not None:
                access.completion_tokens = sum(c.generated for c in calls)
            for call in calls:
                del self._live[call.rid]
                if not call.done:
                    self._abort(b, call)
                if call.accepted:
                    b.admission.release(call.rid, call.generated)

    @staticmethod
    def _batch_fits(b: Backend, prompts: list[list[int]], params: SamplingParams,
                    tenant: TenantConfig, model: str) -> None:
        """A batch no wait could ever admit is a 400, not a 429 to retry forever: more
        prompts than the tenant may run at once or the model may hold, or more tokens than
        the tenant's per-minute budget."""
        n = len(prompts)
        limits = [(tenant.max_concurrent, "the tenant's max_concurrent"),
                  (b.admission.lanes[model].capacity, "the model's capacity")]
        for limit, what in limits:
            if limit is not None and n > limit:
                raise ApiError(400, f"prompt: a batch of {n} prompts is more than {what} "
                               f"({limit}); send fewer at once", param="prompt")
        cost = sum(len(p) for p in prompts) + n * params.max_tokens
        if tenant.tokens_per_minute is not None and cost > tenant.tokens_per_minute:
            raise ApiError(400, f"prompt: the batch may use {cost} tokens, more than the "
                           f"tenant's {tenant.tokens_per_minute} per minute", param="prompt")

    async def _merged(self, calls: list[_Call]) -> AsyncIterator[list[tuple[int, Output]]]:
        """Several calls' outputs as they come, tagged with the call's index."""
        iters = [self._outputs(c) for c in calls]
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
                    got.extend((i, out) for out in outs)
                    pending[asyncio.ensure_future(anext(iters[i]))] = i
                if got:
                    yield got
        finally:
            for fut in pending:
                fut.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for it in iters:
                await it.aclose()

    async def _submit(self, b: Backend, call: _Call, prompt_ids: list[int],
                      params: SamplingParams, tenant: TenantConfig, model: str) -> None:
        self._send(b, call, prompt_ids, params, tenant, model)
        await self._decided(b, call)

    def _send(self, b: Backend, call: _Call, prompt_ids: list[int], params: SamplingParams,
              tenant: TenantConfig, model: str, n: int = 1, after: int | None = None) -> None:
        msg = Submit(call.rid, tuple(prompt_ids), params, time.monotonic(), call.replies,
                     tenant.cache_salt, tenant.name, tenant.priority, model, n=n, after=after)
        try:
            b.admission.inbox.put_nowait(msg)
        except asyncio.QueueFull:  # capacity requests are already ahead of this one
            call.done = True
            b.metrics.emit(AdmissionRejected(call.tenant, "capacity", model))
            f = too_many(b.admission.capacity)
            raise ApiError(f.status, f.message, retry_after=f.retry_after) from None

    async def _decided(self, b: Backend, call: _Call) -> None:
        """Admission's answer to a sent call: accepted (its lane set), or an ApiError."""
        first = await call.replies.get()
        if isinstance(first, Failed):
            call.done = True
            raise ApiError(first.status, first.message, first.param, retry_after=first.retry_after)
        assert isinstance(first, Accepted)
        call.lane = b.admission.lanes[first.model]
        call.accepted = True
        if call.access is not None:
            call.access.model = first.model

    async def _outputs(self, call: _Call) -> AsyncIterator[list[Output]]:
        """The request's outputs until the final one, in batches: whatever has queued up by
        the time the reader comes back (a reader that lags behind the steps writes several
        tokens at once, not one write per token). A Failed becomes an ApiError."""
        while True:
            msgs = [await call.replies.get()]
            while not call.replies.empty() and len(msgs) < MAX_BATCH:
                msgs.append(call.replies.get_nowait())
            outs = []
            for msg in msgs:
                if isinstance(msg, Failed):
                    call.done = True
                    if outs:
                        yield outs
                    raise ApiError(msg.status, msg.message, msg.param,
                                   retry_after=msg.retry_after)
                call.generated = msg.completion_tokens or call.generated
                outs.append(msg)
                if call.access is not None:
                    call.access.completion_tokens = call.generated
                    call.access.first_output = call.access.first_output or time.monotonic()
                    call.access.finish_reason = msg.finish_reason
                if msg.finish_reason is not None:
                    call.done = True
                    yield outs
                    return
            yield outs

    async def _stream(self, request: web.Request,
                      outputs: AsyncIterator[list[tuple[int, Output]]],
                      shaper: ChatShaper | CompletionShaper, answering: str,
                      access: access_log.AccessInfo | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": request[CLIENT_ID], "X-Tinyserve-Model": answering})
        await resp.prepare(request)
        transport = request.transport

        async def send(chunks) -> None:
            data = b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks)
            if not data:
                return
            if (transport is not None and not transport.get_write_buffer_size()
                    and len(data) <= transport.get_write_buffer_limits()[1]):
                # The socket took everything so far and this write fits under the high-water
                # mark: the transport cannot pause, so aiohttp's drain cannot wait on the
                # reader and the write needs no timeout - the common case, and a timer per
                # write was a tenth of the loop's time at 256 streams.
                await resp.write(data)
                return
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await resp.write(data)
            except TimeoutError:  # it stopped reading: treat it as gone (aborts the request)
                raise ConnectionResetError("the client stopped reading the stream") from None

        def shape(outs: list[tuple[int, Output]]) -> list:
            return [chunk for i, out in outs for chunk in shaper.chunks(out, i)]

        await send(shaper.opening())
        loop = asyncio.get_running_loop()
        try:
            async with contextlib.aclosing(outputs):
                async for outs in outputs:
                    if _logprob_entries([out for _, out in outs]) > OFF_LOOP_LOGPROBS:
                        # (a prompt's logprobs: shaped off the loop, as whole bodies are)
                        await send(await loop.run_in_executor(None, shape, outs))
                    else:
                        await send(shape(outs))
        except ApiError as e:  # headers are sent: the error becomes the last event
            self._count_error(e)
            if access is not None:
                access.stream_error = e.status
            await resp.write(b"data: " + e.body() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- client gone, server failing -------------------------------------------------------------
    def _abort(self, b: Backend, call: _Call) -> None:
        if call.accepted:
            self._send_abort(call.lane, call.rid)
            return
        task = asyncio.get_running_loop().create_task(self._abort_once_decided(b, call))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _abort_once_decided(self, b: Backend, call: _Call) -> None:
        """The client left before admission decided: if it accepts, abort right behind."""
        first = await call.replies.get()
        if isinstance(first, Accepted):
            self._send_abort(b.admission.lanes[first.model], call.rid)
            b.admission.release(call.rid)

    def _send_abort(self, lane: Lane, rid: int) -> None:
        try:
            lane.batcher_inbox.put_nowait(Abort(rid))
            lane.aborts_sent += 1
        except asyncio.QueueFull:  # sized so it cannot be (see Lane.in_system)
            log.error("batcher inbox full: request %d could not be aborted", rid)

    def fail_all(self, status: int, message: str, model: str | None = None) -> None:
        """Answer every pending request (of one model, if given) with this error now: the
        supervisor's last resort, or a model that went down."""
        if model is None:
            for task in self._orphans:
                task.cancel()
        failed = Failed(status, message, retry_after=5.0)
        admission = self.backend.admission if self.backend is not None else None
        for call in self._live.values():
            # (accepted, though its handler may not have read the Accepted yet)
            lane = call.lane or (admission.lane_of(call.rid) if admission else None)
            if model is not None and (lane is None or lane.name != model):
                continue  # (one not yet accepted: admission sends it elsewhere or refuses it)
            if lane is not None:  # its handler releases the slot, even if Accepted is dropped
                call.lane, call.accepted = lane, True
            while True:  # the reader only needs the error: drop output it has not read yet
                try:
                    call.replies.put_nowait(failed)
                    break
                except asyncio.QueueFull:
                    call.replies.get_nowait()
            if lane is not None:  # a live batcher may still run it
                self._send_abort(lane, call.rid)

    # -- checks ----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> TenantConfig:
        """The tenant whose key the request carries (constant time over all keys)."""
        tenant = self._find_tenant(request)
        if (access := request.get(ACCESS)) is not None:
            access.tenant = tenant.name
        return tenant

    def _find_tenant(self, request: web.Request) -> TenantConfig:
        tenants = self.cfg.tenant_list
        if len(tenants) == 1 and not tenants[0].api_key:
            return tenants[0]
        # aiohttp keeps undecodable header bytes as surrogates: encode them back, never raise
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "surrogateescape")
        found = None
        for t in tenants:  # no early exit: timing says nothing about which key is close
            if hmac.compare_digest(given, t.api_key.encode()) and scheme.lower() == "bearer":
                found = t
        if found is None:
            raise ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer "
                           "<key>')", code="invalid_api_key")
        return found

    def _admin(self, request: web.Request) -> TenantConfig:
        tenant = self._auth(request)
        if not tenant.admin:
            raise ApiError(403, f"tenant {tenant.name} may not change routes (admin = true in "
                           "the tenants file)", code="permission_denied")
        return tenant

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        try:
            return await request.read()
        except RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match
            raise ApiError(400, f"could not read the request body: {e}") from None

    def _backend(self) -> Backend:
        if self.backend is None:
            raise ApiError(503, "the model is still loading", retry_after=5.0)
        return self.backend


def _logprob_entries(outs: list[Output]) -> int:
    """Logprob entries these Outputs carry: the cost of shaping them into JSON."""
    return sum(len(o.tokens) + len(o.prompt_logprobs or ()) for o in outs)


def _prompt_list(prompt: object) -> list:
    """A completions ``prompt`` as the list of its prompts (as ``prompts._batch`` split it)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: vLLM's seed + j, so each choice differs yet reproduces."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j) % 2**64)


async def _indexed(outputs: AsyncIterator[list[Output]]) -> AsyncIterator[list[tuple[int, Output]]]:
    """One call's outputs as choice 0."""
    async with contextlib.aclosing(outputs):
        async for outs in outputs:
            yield [(0, out) for out in outs]
