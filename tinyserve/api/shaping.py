"""OpenAI response shaping: a request's Outputs -> chat / completion bodies and SSE chunks.

No HTTP here: the generate path and ``sse.py`` move bytes, a Shaper decides what they say.
One shaper per request, for either API, with the same calls: ``opening()`` (chunks sent
before any output), ``chunks(out, i)`` (what choice i's Output becomes when streaming),
``stream_error(e)`` (an error once the stream has begun), ``closing()`` (the stream's last
bytes) and ``body_many(per_choice)`` (the whole answer). The Responses and Messages APIs
(``responses.py``, ``anthropic.py``) have shapers with the same calls.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.api.request_types import ChatCompletionRequest, CompletionRequest
from tinyserve.api.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    FunctionCall,
    FunctionDelta,
    PromptLogprob,
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
from tinyserve.api.tool_parsers import ToolCallDelta
from tinyserve.api.tools import ToolOutput, ToolPlan
from tinyserve.messages import Output, TokenInfo
from tinyserve.text.tokenizer import Tokenizer


def logprob_entries(outs: Sequence[Output]) -> int:
    """Logprob entries these Outputs carry: the cost of shaping them into JSON (a prompt
    position counts its alternatives: the whole vocabulary with prompt_logprobs=-1)."""
    n = 0
    for o in outs:  # (a loop, not nested generators: a stream asks once per batch it sends)
        n += len(o.tokens)
        if o.prompt_logprobs:
            n += sum(1 + len(t.top) for t in o.prompt_logprobs if t)
    return n


def usage(out: Output) -> Usage:
    details = {"cached_tokens": out.cached_tokens} if out.cached_tokens else None
    return Usage(out.prompt_tokens, out.completion_tokens,
                 out.prompt_tokens + out.completion_tokens, details)


def total_usage(finals: Sequence[Output], n: int = 1) -> Usage:
    """One usage for several choices' final outputs, in choice order: ``n`` per prompt (a
    prompt's tokens count once, as OpenAI's n does), over a batch of prompts."""
    firsts = finals[::n]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in finals)
    cached = sum(o.cached_tokens for o in firsts)
    return Usage(prompt, completion, prompt + completion,
                 {"cached_tokens": cached} if cached else None)


class Shaper(abc.ABC):
    """``choices``: n per prompt, in order (choice i answers prompt i // n); ``prompts``: each
    prompt's token ids, as the engine runs them."""

    def __init__(self, req: ChatCompletionRequest | CompletionRequest, model: str,
                 tokenizer: Tokenizer, want_logprobs: bool, choices: int = 1,
                 prompts: Sequence[Sequence[int]] = ()) -> None:
        self.model = model
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.want_prompt_logprobs = req.prompt_logprobs is not None
        self.want_ids = bool(req.return_token_ids)  # vLLM's token_ids / prompt_token_ids
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats (only with include_usage): every chunk carries its
        # choice's usage so far
        self.continuous = self.include_usage and options.continuous_usage_stats
        self.created = now()
        self.choices = choices
        self.n = req.n
        self.prompts = prompts
        self.as_ids = req.return_tokens_as_token_ids  # vLLM: "token_id:{id}" for each token
        self._finals: dict[int, Output] = {}
        self._generated = [0] * choices  # each choice's tokens so far (continuous usage)

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tok.token_text(token_id)

    def _prompt_ids(self, index: int) -> TokenIds:
        return list(self.prompts[index // self.n]) if self.want_ids else msgspec.UNSET

    def _token_ids(self, outs: Sequence[Output]) -> TokenIds:
        return [t for o in outs for t in o.token_ids] if self.want_ids else msgspec.UNSET

    def _running_usage(self, index: int, out: Output | None = None) -> Usage | None:
        """With continuous usage stats, choice ``index``'s usage once ``out`` is in (vLLM's:
        its prompt, and its tokens so far); else None."""
        if not self.continuous:
            return None
        if out is not None:  # (an abort's Output counts nothing: keep the count so far)
            self._generated[index] = max(self._generated[index], out.completion_tokens)
        prompt, done = len(self.prompts[index // self.n]), self._generated[index]
        return Usage(prompt, done, prompt + done)

    def plain(self, index: int) -> bool:
        """Whether an Output that is text alone (no finish, tokens or ids) becomes one chunk
        that differs by its text only and changes nothing here (sse.Events' templates)."""
        return False

    def opening(self) -> list[msgspec.Struct]:
        return []

    def stream_error(self, e: ApiError) -> list:
        """The error as the stream's last event: OpenAI's envelope as a data event."""
        return [e.envelope()]

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def chunks(self, out: Output, index: int = 0) -> list[msgspec.Struct]:
        """What choice ``index``'s Output becomes in the stream; after every choice's last
        one, the usage chunk (if the client asked for it)."""
        got = self._choice_chunks(out, index)
        if (use := self._final(out, index)) is not None:
            got.append(self._usage_chunk(use))
        return got

    def body_many(self, per_choice: Sequence[Sequence[Output]]) -> msgspec.Struct:
        """The whole answer: a choice per list of Outputs, and one usage for them all."""
        choices = [self._choice(i, outs) for i, outs in enumerate(per_choice)]
        return self._body(choices, total_usage([outs[-1] for outs in per_choice], self.n),
                          per_choice)

    def body(self, outs: Sequence[Output]) -> msgspec.Struct:
        return self.body_many([outs])

    @abc.abstractmethod
    def _choice_chunks(self, out: Output, index: int) -> list[msgspec.Struct]: ...

    @abc.abstractmethod
    def _usage_chunk(self, use: Usage) -> msgspec.Struct: ...

    @abc.abstractmethod
    def _choice(self, index: int, outs: Sequence[Output]) -> msgspec.Struct: ...

    @abc.abstractmethod
    def _body(self, choices: list, use: Usage, per_choice: Sequence[Sequence[Output]]
              ) -> msgspec.Struct: ...

    def _final(self, out: Output, index: int) -> Usage | None:
        """Record a choice's last Output; the usage to stream once every choice is done."""
        if out.finish_reason is None:
            return None
        self._finals[index] = out
        if self.include_usage and len(self._finals) == self.choices:
            return total_usage([self._finals[i] for i in range(self.choices)], self.n)
        return None

    def _prompt_logprobs(self, outs: Sequence[Output]) -> PromptLogprobs | msgspec.UnsetType:
        """vLLM's ``prompt_logprobs`` from the Output that carries them (the first)."""
        got = next((o for o in outs if o.prompt_logprobs is not None), None)
        if not self.want_prompt_logprobs or got is None:
            return msgspec.UNSET
        entries: PromptLogprobs = [None]
        for t, rank in zip(got.prompt_logprobs[1:], got.prompt_ranks, strict=True):
            entry = {str(i): PromptLogprob(lp, r + 1, self._text(i))
                     for r, (i, lp) in enumerate(t.top)}
            entry[str(t.token_id)] = PromptLogprob(t.logprob, rank,
                                                   self._text(t.token_id))
            entries.append(entry)
        return entries


class CompletionShaper(Shaper):
    """``echo``: each prompt's (text, token ids), sent before its choices' completions (with
    the prompt's token logprobs when logprobs are asked for, the first one null, as OpenAI
    does)."""

    def __init__(self, req: CompletionRequest, *args, choices: int = 1,
                 echo: Sequence[tuple[str, Sequence[int]]] | None = None, **kw) -> None:
        super().__init__(req, *args, choices=choices, **kw)
        self.id = new_id("cmpl")
        self.echo = echo  # per prompt
        # alternatives per token, echoed prompt tokens too (they may have more: vLLM's
        # prompt_logprobs beside echo and logprobs)
        self.top_n = req.logprobs or 0
        # text_offset of each choice's next token: the running length of its tokens' texts,
        # the same streamed or not (text a stop string holds back does not shift it)
        self._offsets = [0] * choices
        self._started = [False] * choices  # its first chunk is out (the prompt's part in it)

    def plain(self, index: int) -> bool:
        return self._started[index] and not (self.want_logprobs or self.want_ids
                                             or self.continuous)

    def _response(self, choices: list[CompletionChoice], use: Usage | None = None
                  ) -> CompletionResponse:
        return CompletionResponse(self.id, self.model, choices, self.created, use)

    def _choice_chunks(self, out: Output, index: int) -> list[msgspec.Struct]:
        """One chunk per Output; a choice's first also carries its prompt's part: the echo,
        prompt_logprobs, prompt_token_ids (vLLM's)."""
        text, tokens = out.text, list(out.tokens)
        prompt_lps = prompt_ids = msgspec.UNSET
        if not self._started[index]:
            self._started[index] = True
            prompt_lps, prompt_ids = self._prompt_logprobs([out]), self._prompt_ids(index)
            if self.echo is not None:
                prompt_text, ids = self.echo[index // self.n]
                text = prompt_text + text
                tokens = self._echo_tokens(out, ids) + tokens
        lp = None
        if self.want_logprobs:
            lp, self._offsets[index] = self._logprobs(tokens, self._offsets[index])
        return [self._response([CompletionChoice(
            index, text, out.finish_reason, lp, prompt_lps, self._token_ids([out]),
            prompt_ids)], self._running_usage(index, out))]

    def _usage_chunk(self, use: Usage) -> CompletionResponse:
        return self._response([], use)

    def _choice(self, index: int, outs: Sequence[Output]) -> CompletionChoice:
        text = "".join(o.text for o in outs)
        tokens = [t for o in outs for t in o.tokens]
        if self.echo is not None:
            prompt_text, ids = self.echo[index // self.n]
            text = prompt_text + text
            first = next((o for o in outs if o.prompt_logprobs is not None), None)
            tokens = (self._echo_tokens(first, ids) if first else []) + tokens
        lp = self._logprobs(tokens, 0)[0] if self.want_logprobs else None
        return CompletionChoice(index, text, outs[-1].finish_reason, lp,
                                self._prompt_logprobs(outs), self._token_ids(outs),
                                self._prompt_ids(index))

    def _body(self, choices: list, use: Usage, per_choice: Sequence[Sequence[Output]]
              ) -> CompletionResponse:
        return self._response(choices, use)

    @staticmethod
    def _echo_tokens(out: Output, ids: Sequence[int]) -> list[TokenInfo | int]:
        """The prompt's tokens: its first as a bare id (nothing precedes it: no logprob)."""
        if out.prompt_logprobs is None:
            return []
        return [ids[0], *out.prompt_logprobs[1:]]

    def _logprobs(self, tokens: Sequence[TokenInfo | int], offset: int
                  ) -> tuple[CompletionLogprobs, int]:
        strs, offsets, lps, tops = [], [], [], []
        for t in tokens:
            offsets.append(offset)
            if isinstance(t, int):  # an echoed prompt's first token: OpenAI's nulls
                s = self._text(t)
                lps.append(None)
                tops.append(None)
            else:
                s = self._text(t.token_id)
                lps.append(t.logprob)
                tops.append(self._top(t, s))
            strs.append(s)
            offset += len(s)
        return CompletionLogprobs(tokens=strs, token_logprobs=lps, top_logprobs=tops,
                                  text_offset=offsets), offset

    def _top(self, t: TokenInfo, text: str) -> dict[str, float]:
        """The N most likely tokens, and the sampled one whether or not it is among them
        (vLLM's completions: so ``logprobs=0`` still names the sampled token)."""
        top = {self._text(i): lp for i, lp in t.top[:self.top_n]}
        top.setdefault(text, t.logprob)
        return top


class ChatShaper(Shaper):
    """``tools``: each choice's text goes through a ToolOutput (content and tool_calls)."""

    def __init__(self, *args, choices: int = 1, tools: ToolPlan | None = None, **kw) -> None:
        super().__init__(*args, choices=choices, **kw)
        self.id = new_id("chatcmpl")
        self.tools = [ToolOutput(tools) for _ in range(choices)] if tools else None

    def plain(self, index: int) -> bool:
        return self.tools is None and not (self.want_logprobs or self.want_ids
                                           or self.continuous)

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None,
               prompt_ids: TokenIds = msgspec.UNSET) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.model, choices, self.created, use,
                                   prompt_token_ids=prompt_ids)

    def opening(self) -> list[msgspec.Struct]:
        """A role chunk per choice, with vLLM's prompt_token_ids and (continuous usage) the
        prompt's usage."""
        return [self._chunk([ChatChunkChoice(i, Delta(role="assistant", content=""))],
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
        text, calls, reason = out.text, None, out.finish_reason
        if self.tools is not None:
            tool = self.tools[index]
            text, deltas = tool.step(out.text, reason is not None)
            if reason is not None:
                reason = tool.finish_reason(reason)
            calls = [_delta(d) for d in deltas] or None
        if text or calls or lp is not None or out.token_ids:
            last = reason if self.continuous else None
            got.append(self._chunk([ChatChunkChoice(
                index, Delta(content=text if text or not calls else None, tool_calls=calls),
                last, lp, ids)], use))
            if last is not None:
                return got
            ids = msgspec.UNSET
        if reason is not None:
            got.append(self._chunk([ChatChunkChoice(index, Delta(), reason, token_ids=ids)],
                                   use))
        return got

    def _usage_chunk(self, use: Usage) -> ChatCompletionChunk:
        return self._chunk([], use)

    def _choice(self, index: int, outs: Sequence[Output]) -> ChatChoice:
        tokens = [t for o in outs for t in o.tokens]
        lp = self._logprobs(tokens) if self.want_logprobs else None
        text, reason = "".join(o.text for o in outs), outs[-1].finish_reason
        message = ResponseMessage("assistant", text)
        if self.tools is not None:
            content, calls = self.tools[index].whole(text)
            if calls:
                message = ResponseMessage("assistant", content, [
                    ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in calls])
                reason = self.tools[index].finish_reason(reason)
        return ChatChoice(index, message, reason, lp, self._token_ids(outs))

    def _body(self, choices: list, use: Usage, per_choice: Sequence[Sequence[Output]]
              ) -> ChatCompletionResponse:
        return ChatCompletionResponse(self.id, self.model, choices, use, self.created,
                                      prompt_logprobs=self._prompt_logprobs(per_choice[0]),
                                      prompt_token_ids=self._prompt_ids(0))

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> ChatLogprobs:
        def entry(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(self._text(tid), lp, self.tok.token_bytes(tid))

        return ChatLogprobs([
            TokenLogprob(e.token, e.logprob, e.bytes, [entry(i, lp) for i, lp in t.top])
            for t in tokens for e in [entry(t.token_id, t.logprob)]])


def _delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    """A tool call's streamed piece: the first names it (id, type, name), the rest append
    to its arguments, as OpenAI streams them."""
    if d.id is not None:
        return ToolCallDeltaOut(d.index, FunctionDelta(d.name, d.arguments), d.id, "function")
    return ToolCallDeltaOut(d.index, FunctionDelta(arguments=d.arguments))
