"""What OpenAI's two generate routes share in their answers: usage, logprobs per token as
text, vLLM's prompt_logprobs, token ids, continuous usage stats and the stream's ends. The
chat and completion shapers (``chat.py``, ``completion.py``) follow api/shaper.py's protocol.

``choices``: n per prompt, in order (choice i answers prompt i // n); ``prompts``: each
prompt's token ids, as the engine runs them; ``whole``: the shaper makes the stream a whole
answer is folded from (its usage chunk always, whatever stream_options say).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.api.openai.bodies import PromptLogprob, PromptLogprobs, TokenIds, Usage
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest
from tinyserve.api.shaper import Counts, counts
from tinyserve.messages import Output
from tinyserve.text.tokenizer import Tokenizer


def usage(c: Counts) -> Usage:
    return Usage(c.prompt, c.completion, c.total,
                 {"cached_tokens": c.cached} if c.cached else None)


class OpenAIShaper:
    def __init__(self, req: ChatCompletionRequest | CompletionRequest, model: str,
                 tokenizer: Tokenizer, want_logprobs: bool, *, choices: int = 1,
                 prompts: Sequence[Sequence[int]] = (), whole: bool = False) -> None:
        self.model = model
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.want_prompt_logprobs = req.prompt_logprobs is not None
        self.want_ids = bool(req.return_token_ids)  # vLLM's token_ids / prompt_token_ids
        options = req.stream_options
        self.include_usage = whole or bool(options and options.include_usage)
        # vLLM's continuous_usage_stats (only with include_usage): every chunk carries its
        # choice's usage so far
        self.continuous = not whole and self.include_usage and options.continuous_usage_stats
        self.choices = choices
        self.n = req.n
        self.prompts = prompts
        self.as_ids = req.return_tokens_as_token_ids  # vLLM: "token_id:{id}" for each token
        self._finals: dict[int, Output] = {}
        self._generated = [0] * choices  # each choice's tokens so far (continuous usage)

    # -- the stream's ends ------------------------------------------------------------------
    def opening(self) -> list[msgspec.Struct]:
        return []

    def stream_error(self, e: ApiError) -> list:
        """The error as the stream's last event: OpenAI's envelope as a data event."""
        return [e.envelope()]

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def chunks(self, out: Output, index: int = 0) -> list[msgspec.Struct]:
        """What choice ``index``'s Output becomes in the stream (the subclass's
        ``_choice_chunks``); after every choice's last one, the usage chunk (``_usage_chunk``;
        if the client asked for it, or the answer is whole)."""
        got = self._choice_chunks(out, index)
        if (use := self._final(out, index)) is not None:
            got.append(self._usage_chunk(use))
        return got

    def _final(self, out: Output, index: int) -> Usage | None:
        """Record a choice's last Output; the usage to stream once every choice is done."""
        if out.finish_reason is None:
            return None
        self._finals[index] = out
        if self.include_usage and len(self._finals) == self.choices:
            return usage(counts([self._finals[i] for i in range(self.choices)], self.n))
        return None

    # -- per token ----------------------------------------------------------------------------
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

    def _prompt_logprobs(self, out: Output) -> PromptLogprobs | msgspec.UnsetType:
        """vLLM's ``prompt_logprobs``, from the Output that carries them (a choice's first)."""
        if not self.want_prompt_logprobs or out.prompt_logprobs is None:
            return msgspec.UNSET
        entries: PromptLogprobs = [None]
        for t, rank in zip(out.prompt_logprobs[1:], out.prompt_ranks, strict=True):
            entry = {str(i): PromptLogprob(lp, r + 1, self._text(i))
                     for r, (i, lp) in enumerate(t.top)}
            entry[str(t.token_id)] = PromptLogprob(t.logprob, rank, self._text(t.token_id))
            entries.append(entry)
        return entries
