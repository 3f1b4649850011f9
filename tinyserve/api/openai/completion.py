"""Completions' answers: a request's Outputs as ``text_completion`` chunks, and the
completion a client folds from them (the whole answer is that fold).

``echo``: each prompt's (text, token ids), sent before its choices' completions (with the
prompt's token logprobs when logprobs are asked for, the first one null, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from tinyserve.api.openai.bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    new_id,
    now,
)
from tinyserve.api.openai.requests import CompletionRequest
from tinyserve.api.openai.shaping import OpenAIShaper
from tinyserve.messages import Output, TokenInfo


class CompletionShaper(OpenAIShaper):
    def __init__(self, req: CompletionRequest, *args,
                 echo: Sequence[tuple[str, Sequence[int]]] | None = None, **kw) -> None:
        super().__init__(req, *args, **kw)
        self.id = new_id("cmpl")
        self.created = now()
        self.echo = echo  # per prompt
        # alternatives per token, echoed prompt tokens too (they may have more: vLLM's
        # prompt_logprobs beside echo and logprobs)
        self.top_n = req.logprobs or 0
        # text_offset of each choice's next token: the running length of its tokens' texts,
        # the same streamed or not (text a stop string holds back does not shift it)
        self._offsets = [0] * self.choices
        self._started = [False] * self.choices  # its first chunk is out (the prompt's part)

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
            prompt_lps, prompt_ids = self._prompt_logprobs(out), self._prompt_ids(index)
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

    def fold(self, chunks: Sequence[CompletionResponse]) -> CompletionResponse:
        """The completion a client builds from these chunks."""
        choices: dict[int, _Choice] = {}
        use = None
        for chunk in chunks:
            if not chunk.choices and chunk.usage is not None:
                use = chunk.usage  # (the usage chunk, after every choice's last)
            for c in chunk.choices:
                choices.setdefault(c.index, _Choice(c)).add(c)
        return self._response([choices[i].whole(self.want_ids) for i in sorted(choices)], use)

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


@dataclass(slots=True)
class _Choice:
    """One choice as its chunks build it (the first carries the prompt's part)."""

    first: CompletionChoice
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, c: CompletionChoice) -> None:
        self.text.append(c.text)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = CompletionLogprobs([], [], [], [])
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(self.logprobs, name).extend(getattr(c.logprobs, name))
        if c.token_ids is not msgspec.UNSET:
            self.token_ids.extend(c.token_ids)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason

    def whole(self, want_ids: bool) -> CompletionChoice:
        return CompletionChoice(self.first.index, "".join(self.text), self.finish_reason,
                                self.logprobs, self.first.prompt_logprobs,
                                self.token_ids if want_ids else msgspec.UNSET,
                                self.first.prompt_token_ids)
