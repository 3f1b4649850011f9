"""Ingress: the aiohttp front end (OpenAI-compatible API, probes, metrics).

Per request: check the key, parse and validate the body (400 naming the field), tokenize,
assign an id, submit to admission, then stream SSE chunks or return one JSON body as the
request's outputs arrive on its own bounded queue. A client that disconnects (the handler is
cancelled, or a write fails) aborts its sequence, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from tinyserve.messages import Abort, Accepted, Output, Rejected, RequestFailed, Submit, TokenInfo
from tinyserve.protocol import (
    ApiError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    decode_request,
    message_text,
    new_id,
    now,
    to_sampling_params,
)

if TYPE_CHECKING:
    from tinyserve.server import Server

log = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")


class Ingress:
    def __init__(self, server: Server) -> None:
        self.s = server  # the wiring: config, engine facts, the other actors

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._request_id_mw, self._error_mw],
                              client_max_size=8 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        return app

    # -- middleware ----------------------------------------------------------------------------
    @web.middleware
    async def _request_id_mw(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        request["request_id"] = rid if _REQUEST_ID_OK.match(rid) else uuid.uuid4().hex
        resp = await handler(request)
        if not resp.prepared:
            resp.headers["X-Request-Id"] = request["request_id"]
        return resp

    @web.middleware
    async def _error_mw(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return self._error_response(e)
        except web.HTTPException as e:  # 404/405 from the router, in the OpenAI envelope
            if e.status >= 400:
                return self._error_response(ApiError(e.status, e.reason or "error"))
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return self._error_response(ApiError(500, "internal server error"))

    def _error_response(self, e: ApiError) -> web.Response:
        if self.s.metrics is not None:
            self.s.metrics.emit(RequestFailed(str(e.status)))
        resp = web.Response(body=e.body(), status=e.status, content_type="application/json")
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, round(e.retry_after)))
        return resp

    # -- probes --------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the loop answers (it is answering) and the executor is alive."""
        ex = self.s.executor
        if ex is not None and not ex.alive:
            return _json({"status": "executor dead"}, 503)
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        adm = self.s.admission
        if adm is None or not adm.ready:
            return _json({"status": "loading"}, 503)
        if adm.draining:
            return _json({"status": "draining"}, 503)
        return _json({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.s.metrics is None:
            raise ApiError(503, "metrics are not available until the model is loaded")
        return web.Response(body=self.s.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        self._auth(request)
        info = self._engine_info()
        return _json(ModelList([ModelCard(self.s.model_name, info.max_model_len)]))

    # -- helpers -------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> None:
        key = self.s.cfg.api_key
        if not key:
            return
        got = request.headers.get("Authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), key.encode())):
            raise ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer "
                           "<key>')", code="invalid_api_key")

    def _engine_info(self):
        if self.s.info is None:
            raise ApiError(503, "the model is still loading", retry_after=5.0)
        return self.s.info

    def _check_model(self, model: str) -> None:
        if model != self.s.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str,
                    prompt_param: str) -> int:
        max_len = self._engine_info().max_model_len
        if requested is not None and requested < 1:
            raise ApiError(400, f"{param} must be at least 1, got {requested}", param=param)
        if prompt_len >= max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, your prompt has {prompt_len} tokens.", param=prompt_param,
                           code="context_length_exceeded")
        if requested is None:
            return max_len - prompt_len
        if prompt_len + requested > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, you requested {prompt_len + requested} tokens "
                           f"({prompt_len} in the prompt, {requested} in the completion).",
                           param=param, code="context_length_exceeded")
        return requested

    async def _submit(self, request: web.Request, prompt_ids: list[int], params,
                      salt: bytes) -> asyncio.Queue:
        adm = self.s.admission
        if adm is None or not adm.ready:
            raise ApiError(503, "the model is not ready", retry_after=5.0)
        # Bounded by construction: Accepted + one Output per generated token + a final one.
        replies: asyncio.Queue = asyncio.Queue(maxsize=params.max_tokens + 4)
        msg = Submit(request["request_id"], tuple(prompt_ids), params, time.monotonic(),
                     replies, salt)
        try:
            adm.inbox.put_nowait(msg)
        except asyncio.QueueFull:
            raise ApiError(503, "the server is overloaded", retry_after=2.0) from None
        first = await replies.get()
        if isinstance(first, Rejected):
            raise ApiError(first.status, first.message, retry_after=first.retry_after)
        assert isinstance(first, Accepted)
        return replies

    async def _outputs(self, request: web.Request, replies: asyncio.Queue
                       ) -> AsyncIterator[Output]:
        """The request's outputs until the final one; aborts the sequence if we stop early."""
        done = False
        try:
            while True:
                msg = await replies.get()
                if isinstance(msg, Rejected):
                    done = True
                    raise ApiError(msg.status, msg.message, retry_after=msg.retry_after)
                if msg.finish_reason == "error":
                    done = True
                    raise ApiError(500, "the engine failed while running this request")
                yield msg
                if msg.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:  # client gone (handler cancelled / write failed): free its blocks
                self.s.batcher.inbox.put_nowait(Abort(request["request_id"]))

    async def _collect(self, request: web.Request, replies: asyncio.Queue
                       ) -> tuple[str, list[TokenInfo], Output]:
        """Non-streaming: every output joined (text, token logprobs, the final output)."""
        text, tokens, last = [], [], None
        async with contextlib.aclosing(self._outputs(request, replies)) as outputs:
            async for out in outputs:
                text.append(out.text)
                tokens.extend(out.tokens)
                last = out
        return "".join(text), tokens, last

    @contextlib.asynccontextmanager
    async def _stream(self, request: web.Request, resp: web.StreamResponse,
                      replies: asyncio.Queue) -> AsyncIterator[AsyncIterator[Output]]:
        """Outputs for an SSE response: once headers are sent, an error becomes an SSE event."""
        try:
            async with contextlib.aclosing(self._outputs(request, replies)) as outputs:
                yield outputs
        except ApiError as e:
            self.s.metrics.emit(RequestFailed(str(e.status)))
            await resp.write(b"data: " + e.body() + b"\n\n")

    def _encode_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: batched prompts are not supported; send one "
                               "request per prompt", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            return self.s.tokenizer.encode(prompt)
        vocab = self._engine_info().vocab_size
        if not prompt or not all(type(t) is int for t in prompt):
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids",
                           param="prompt")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab})", param="prompt")
        return list(prompt)

    def _token_str(self, token_id: int) -> str:
        return self.s.tokenizer.token_text(token_id)

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        req = decode_request(await request.read(), CompletionRequest)
        self._engine_info()
        self._check_model(req.model)
        prompt_ids = self._encode_prompt(req)
        params = to_sampling_params(
            req, self._max_tokens(16 if req.max_tokens is None else req.max_tokens,
                                  len(prompt_ids), "max_tokens", "prompt"))
        replies = await self._submit(request, prompt_ids, params, b"")
        cid = new_id("cmpl")
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text, finish, lp, usage=None, choices=True):
            return CompletionResponse(cid, self.s.model_name,
                                      [CompletionChoice(0, text, finish, lp)] if choices else [],
                                      created, usage)

        if req.stream:
            resp = await self._sse_start(request)
            offset = 0
            async with self._stream(request, resp, replies) as outputs:
                async for out in outputs:
                    lp = self._completion_logprobs(out.tokens, offset) \
                        if params.logprobs is not None else None
                    offset += len(out.text)
                    await self._sse_send(resp, chunk(out.text, out.finish_reason, lp))
                    if out.finish_reason is not None and include_usage:
                        await self._sse_send(resp, chunk("", None, None, _usage(out), False))
            return await self._sse_end(resp)

        text, tokens, last = await self._collect(request, replies)
        lp = self._completion_logprobs(tokens, 0) if params.logprobs is not None else None
        return _json(chunk(text, last.finish_reason, lp, _usage(last)))

    def _completion_logprobs(self, tokens: tuple[TokenInfo, ...] | list[TokenInfo],
                             offset: int) -> CompletionLogprobs:
        strs, offsets = [], []
        for t in tokens:
            offsets.append(offset)
            s = self._token_str(t.token_id)
            strs.append(s)
            offset += len(s)
        return CompletionLogprobs(
            tokens=strs, token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{self._token_str(i): lp for i, lp in t.top} for t in tokens],
            text_offset=offsets)

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        req = decode_request(await request.read(), ChatCompletionRequest)
        self._engine_info()
        self._check_model(req.model)
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
        try:
            prompt = self.s.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt_ids = self.s.tokenizer.encode(prompt, add_special_tokens=False)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = to_sampling_params(req, self._max_tokens(requested, len(prompt_ids), param,
                                                          "messages"))
        replies = await self._submit(request, prompt_ids, params, b"")
        cid = new_id("chatcmpl")
        created = now()
        want_lp = params.logprobs is not None

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            resp = await self._sse_start(request)
            await self._sse_send(resp, ChatCompletionChunk(
                cid, self.s.model_name, [ChatChunkChoice(0, Delta(role="assistant", content=""))],
                created))
            async with self._stream(request, resp, replies) as outputs:
                async for out in outputs:
                    lp = self._chat_logprobs(out.tokens) if want_lp else None
                    if out.text or lp is not None:
                        await self._sse_send(resp, ChatCompletionChunk(
                            cid, self.s.model_name,
                            [ChatChunkChoice(0, Delta(content=out.text), None, lp)], created))
                    if out.finish_reason is not None:
                        await self._sse_send(resp, ChatCompletionChunk(
                            cid, self.s.model_name,
                            [ChatChunkChoice(0, Delta(), out.finish_reason)], created))
                        if include_usage:
                            await self._sse_send(resp, ChatCompletionChunk(
                                cid, self.s.model_name, [], created, _usage(out)))
            return await self._sse_end(resp)

        text, tokens, last = await self._collect(request, replies)
        choice = ChatChoice(0, ResponseMessage("assistant", text), last.finish_reason,
                            self._chat_logprobs(tokens) if want_lp else None)
        return _json(ChatCompletionResponse(cid, self.s.model_name, [choice], _usage(last),
                                            created))

    def _chat_logprobs(self, tokens) -> ChatLogprobs:
        def entry(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(self._token_str(tid), lp, self.s.tokenizer.token_bytes(tid))

        return ChatLogprobs([
            TokenLogprob(e.token, e.logprob, e.bytes, [entry(i, lp) for i, lp in t.top])
            for t in tokens for e in [entry(t.token_id, t.logprob)]])

    # -- SSE -----------------------------------------------------------------------------------
    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": request["request_id"]})
        await resp.prepare(request)
        return resp

    async def _sse_send(self, resp: web.StreamResponse, obj) -> None:
        await resp.write(b"data: " + msgspec.json.encode(obj) + b"\n\n")

    async def _sse_end(self, resp: web.StreamResponse) -> web.StreamResponse:
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(out: Output) -> Usage:
    details = {"cached_tokens": out.cached_tokens} if out.cached_tokens else None
    return Usage(out.prompt_tokens, out.completion_tokens,
                 out.prompt_tokens + out.completion_tokens, details)
