"""Chat completions' answers: a request's Outputs as ``chat.completion.chunk`` events, and
the ``chat.completion`` a client folds from them (the whole answer is that fold)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from tinyserve.api.openai.bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    FunctionCall,
    FunctionDelta,
    PromptLogprobs,
    ResponseMessage,
    TokenIds,
    TokenLogprob,
    ToolCallDeltaOut,
    ToolCallOut,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from tinyserve.api.openai.shaping import OpenAIShaper
from tinyserve.api.tools.output import ToolOutput
from tinyserve.api.tools.parsers import ToolCallDelta
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.messages import Output, TokenInfo


class ChatShaper(OpenAIShaper):
    """``tools``: each choice's text goes through a ToolOutput (content and tool_calls)."""

    def __init__(self, *args, tools: ToolPlan | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.id = new_id("chatcmpl")
        self.created = now()
        self.tools = [ToolOutput(tools) for _ in range(self.choices)] if tools else None

    def plain(self, index: int) -> bool:
        return self.tools is None and not (self.want_logprobs or self.want_ids
                                           or self.continuous)

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None,
               prompt_ids: TokenIds = msgspec.UNSET,
               prompt_lps: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
               ) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.model, choices, self.created, use,
                                   prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps)

    def opening(self) -> list[msgspec.Struct]:
        """A role chunk per choice, with vLLM's prompt_token_ids and (continuous usage) the
        prompt's usage. Its content is "" unless tools may be called: then none, as OpenAI's
        when a call comes, so an answer of calls alone folds to content null."""
        content = "" if self.tools is None else None
        return [self._chunk([ChatChunkChoice(i, Delta(role="assistant", content=content))],
                            self._running_usage(i), self._prompt_ids(i))
                for i in range(self.choices)]

    def _choice_chunks(self, out: Output, index: int) -> list[msgspec.Struct]:
        """A chunk with the Output's delta (text, tool-call pieces, logprobs, token ids), then
        one with its finish reason, as OpenAI streams them; with continuous usage the finish
        reason rides on the last delta instead (vLLM's: each chunk with a choice then counts
        tokens the one before it did not)."""
        got = []
        use, ids = self._running_usage(index, out), self._token_ids([out])
        lp = self._logprobs(out.tokens) if self.want_logprobs else None
        prompt_lps = self._prompt_logprobs(out) if index == 0 else msgspec.UNSET
        text, calls, reason = out.text, None, out.finish_reason
        if self.tools is not None:
            tool = self.tools[index]
            text, deltas = tool.step(out.text, reason is not None)
            if reason is not None:
                reason = tool.finish_reason(reason)
            calls = [_delta(d) for d in deltas] or None
        if (text or calls or lp is not None or out.token_ids
                or prompt_lps is not msgspec.UNSET):
            last = reason if self.continuous else None
            got.append(self._chunk([ChatChunkChoice(
                index, Delta(content=text if text or not calls else None, tool_calls=calls),
                last, lp, ids)], use, prompt_lps=prompt_lps))
            if last is not None:
                return got
            ids = msgspec.UNSET
        if reason is not None:
            got.append(self._chunk([ChatChunkChoice(index, Delta(), reason, token_ids=ids)],
                                   use))
        return got

    def _usage_chunk(self, use: Usage) -> ChatCompletionChunk:
        return self._chunk([], use)

    def fold(self, chunks: Sequence[ChatCompletionChunk]) -> ChatCompletionResponse:
        """The ``chat.completion`` a client builds from these chunks."""
        choices: dict[int, _Choice] = {}
        use = None
        prompt_ids: TokenIds = msgspec.UNSET
        prompt_lps: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
        for chunk in chunks:
            if not chunk.choices and chunk.usage is not None:
                use = chunk.usage  # (the usage chunk, after every choice's last)
            if chunk.prompt_logprobs is not msgspec.UNSET:
                prompt_lps = chunk.prompt_logprobs
            for c in chunk.choices:
                if c.index == 0 and chunk.prompt_token_ids is not msgspec.UNSET:
                    prompt_ids = chunk.prompt_token_ids
                choices.setdefault(c.index, _Choice()).add(c)
        return ChatCompletionResponse(
            self.id, self.model, [choices[i].message(i, self.want_ids) for i in sorted(choices)],
            use, self.created, prompt_logprobs=prompt_lps, prompt_token_ids=prompt_ids)

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> ChatLogprobs:
        def entry(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(self._text(tid), lp, self.tok.token_bytes(tid))

        return ChatLogprobs([
            TokenLogprob(e.token, e.logprob, e.bytes, [entry(i, lp) for i, lp in t.top])
            for t in tokens for e in [entry(t.token_id, t.logprob)]])


@dataclass(slots=True)
class _Choice:
    """One choice as its chunks build it, as the openai client folds them: content null until
    a chunk carries some (the role chunk's "" included)."""

    content: list[str] | None = None
    calls: dict[int, list] = field(default_factory=dict)  # index -> [id, name, arguments...]
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, c: ChatChunkChoice) -> None:
        if c.delta.content is not None:
            self.content = (self.content or []) + [c.delta.content]
        for d in c.delta.tool_calls or ():
            call = self.calls.setdefault(d.index, [d.id, d.function.name])
            call.append(d.function.arguments or "")
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs.content
        if c.token_ids is not msgspec.UNSET:
            self.token_ids.extend(c.token_ids)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason

    def message(self, index: int, want_ids: bool) -> ChatChoice:
        content = None if self.content is None else "".join(self.content)
        calls = [ToolCallOut(cid, FunctionCall(name, "".join(args)))
                 for cid, name, *args in (self.calls[k] for k in sorted(self.calls))]
        message = ResponseMessage("assistant", content, calls or msgspec.UNSET)
        return ChatChoice(index, message, self.finish_reason,
                          None if self.logprobs is None else ChatLogprobs(self.logprobs),
                          self.token_ids if want_ids else msgspec.UNSET)


def _delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    """A tool call's streamed piece: the first names it (id, type, name), the rest append
    to its arguments, as OpenAI streams them."""
    if d.id is not None:
        return ToolCallDeltaOut(d.index, FunctionDelta(d.name, d.arguments), d.id, "function")
    return ToolCallDeltaOut(d.index, FunctionDelta(arguments=d.arguments))
