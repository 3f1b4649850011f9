"""OpenAI response shaping: a request's Outputs -> chat / completion bodies and SSE chunks.

No HTTP here: ingress moves bytes, a Shaper decides what they say. One shaper per request,
for either API, with the same three calls: ``opening()`` (chunks sent before any output),
``chunks(out)`` (what one Output becomes when streaming) and ``body(outs)`` (the whole answer).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import msgspec

from tinyserve.engine.tokenizer import Tokenizer
from tinyserve.messages import Output, TokenInfo
from tinyserve.protocol import (
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
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
    now,
)


def usage(out: Output) -> Usage:
    details = {"cached_tokens": out.cached_tokens} if out.cached_tokens else None
    return Usage(out.prompt_tokens, out.completion_tokens,
                 out.prompt_tokens + out.completion_tokens, details)


class Shaper(abc.ABC):
    def __init__(self, req: ChatCompletionRequest | CompletionRequest, model: str,
                 tokenizer: Tokenizer, want_logprobs: bool) -> None:
        self.model = model
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.created = now()

    def opening(self) -> list[msgspec.Struct]:
        return []

    @abc.abstractmethod
    def chunks(self, out: Output) -> list[msgspec.Struct]: ...

    @abc.abstractmethod
    def body(self, outs: Sequence[Output]) -> msgspec.Struct: ...


class CompletionShaper(Shaper):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.id = new_id("cmpl")
        self._offset = 0  # text_offset of the next streamed token

    def _response(self, choices: list[CompletionChoice], use: Usage | None = None
                  ) -> CompletionResponse:
        return CompletionResponse(self.id, self.model, choices, self.created, use)

    def chunks(self, out: Output) -> list[msgspec.Struct]:
        lp = self._logprobs(out.tokens, self._offset) if self.want_logprobs else None
        self._offset += len(out.text)
        got = [self._response([CompletionChoice(0, out.text, out.finish_reason, lp)])]
        if out.finish_reason is not None and self.include_usage:
            got.append(self._response([], usage(out)))
        return got

    def body(self, outs: Sequence[Output]) -> CompletionResponse:
        tokens = [t for o in outs for t in o.tokens]
        lp = self._logprobs(tokens, 0) if self.want_logprobs else None
        last = outs[-1]
        return self._response([CompletionChoice(0, "".join(o.text for o in outs),
                                                last.finish_reason, lp)], usage(last))

    def _logprobs(self, tokens: Sequence[TokenInfo], offset: int) -> CompletionLogprobs:
        strs, offsets = [], []
        for t in tokens:
            offsets.append(offset)
            s = self.tok.token_text(t.token_id)
            strs.append(s)
            offset += len(s)
        return CompletionLogprobs(
            tokens=strs, token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{self.tok.token_text(i): lp for i, lp in t.top} for t in tokens],
            text_offset=offsets)


class ChatShaper(Shaper):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.id = new_id("chatcmpl")

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None
               ) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.model, choices, self.created, use)

    def opening(self) -> list[msgspec.Struct]:
        return [self._chunk([ChatChunkChoice(0, Delta(role="assistant", content=""))])]

    def chunks(self, out: Output) -> list[msgspec.Struct]:
        got = []
        lp = self._logprobs(out.tokens) if self.want_logprobs else None
        if out.text or lp is not None:
            got.append(self._chunk([ChatChunkChoice(0, Delta(content=out.text), None, lp)]))
        if out.finish_reason is not None:
            got.append(self._chunk([ChatChunkChoice(0, Delta(), out.finish_reason)]))
            if self.include_usage:
                got.append(self._chunk([], usage(out)))
        return got

    def body(self, outs: Sequence[Output]) -> ChatCompletionResponse:
        last = outs[-1]
        lp = self._logprobs([t for o in outs for t in o.tokens]) if self.want_logprobs else None
        choice = ChatChoice(0, ResponseMessage("assistant", "".join(o.text for o in outs)),
                            last.finish_reason, lp)
        return ChatCompletionResponse(self.id, self.model, [choice], usage(last), self.created)

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> ChatLogprobs:
        def entry(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(self.tok.token_text(tid), lp, self.tok.token_bytes(tid))

        return ChatLogprobs([
            TokenLogprob(e.token, e.logprob, e.bytes, [entry(i, lp) for i, lp in t.top])
            for t in tokens for e in [entry(t.token_id, t.logprob)]])
