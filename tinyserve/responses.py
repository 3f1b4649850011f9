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


def total_usage(finals: Sequence[Output]) -> Usage:
    """One usage for several prompts' final outputs (a batched completions request)."""
    prompt = sum(o.prompt_tokens for o in finals)
    completion = sum(o.completion_tokens for o in finals)
    cached = sum(o.cached_tokens for o in finals)
    return Usage(prompt, completion, prompt + completion,
                 {"cached_tokens": cached} if cached else None)


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
    def chunks(self, out: Output, index: int = 0) -> list[msgspec.Struct]: ...

    @abc.abstractmethod
    def body(self, outs: Sequence[Output]) -> msgspec.Struct: ...


class CompletionShaper(Shaper):
    def __init__(self, *args, choices: int = 1) -> None:
        super().__init__(*args)
        self.id = new_id("cmpl")
        self.n = choices  # one per prompt of a batched request
        self._offsets = [0] * choices  # text_offset of each choice's next streamed token
        self._finals: dict[int, Output] = {}

    def _response(self, choices: list[CompletionChoice], use: Usage | None = None
                  ) -> CompletionResponse:
        return CompletionResponse(self.id, self.model, choices, self.created, use)

    def chunks(self, out: Output, index: int = 0) -> list[msgspec.Struct]:
        lp = self._logprobs(out.tokens, self._offsets[index]) if self.want_logprobs else None
        self._offsets[index] += len(out.text)
        got = [self._response([CompletionChoice(index, out.text, out.finish_reason, lp)])]
        if out.finish_reason is not None:
            self._finals[index] = out
            if self.include_usage and len(self._finals) == self.n:  # after the last choice
                got.append(self._response([], total_usage(list(self._finals.values()))))
        return got

    def body(self, outs: Sequence[Output]) -> CompletionResponse:
        return self.body_many([outs])

    def body_many(self, per_choice: Sequence[Sequence[Output]]) -> CompletionResponse:
        choices = []
        for i, outs in enumerate(per_choice):
            tokens = [t for o in outs for t in o.tokens]
            lp = self._logprobs(tokens, 0) if self.want_logprobs else None
            choices.append(CompletionChoice(i, "".join(o.text for o in outs),
                                            outs[-1].finish_reason, lp))
        return self._response(choices, total_usage([outs[-1] for outs in per_choice]))

    def _logprobs(self, tokens: Sequence[TokenInfo], offset: int) -> CompletionLogprobs:
        strs, offsets = [], []
        for t in tokens:
            offsets.append(offset)
            s = self.tok.token_text(t.token_id)
            strs.append(s)
            offset += len(s)
        return CompletionLogprobs(
            tokens=strs, token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[self._top(t, s) for t, s in zip(tokens, strs)], text_offset=offsets)

    def _top(self, t: TokenInfo, text: str) -> dict[str, float]:
        """The N most likely tokens, and the sampled one whether or not it is among them
        (vLLM's completions: so ``logprobs=0`` still names the sampled token)."""
        top = {self.tok.token_text(i): lp for i, lp in t.top}
        top.setdefault(text, t.logprob)
        return top


class ChatShaper(Shaper):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.id = new_id("chatcmpl")

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None
               ) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.model, choices, self.created, use)

    def opening(self) -> list[msgspec.Struct]:
        return [self._chunk([ChatChunkChoice(0, Delta(role="assistant", content=""))])]

    def chunks(self, out: Output, index: int = 0) -> list[msgspec.Struct]:
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
