"""What an API makes of a request's Outputs: the Shaper protocol every front follows, and the
one rule that keeps whole and streamed answers the same - a whole answer is the fold of the
stream its shaper would have sent.

    opening()           chunks before any output (OpenAI chat: a role chunk per choice)
    chunks(out, i)      what choice i's Output becomes in the stream
    stream_error(e)     an error once the stream has begun, in the API's words
    closing()           the stream's last bytes (OpenAI: ``data: [DONE]``)
    plain(i)            an Output that is text alone changes nothing but the text of choice
                        i's chunk (sse.Events may then splice the text into a template)
    fold(chunks)        the whole answer a client builds from a complete stream

A shaper made for a whole answer (``whole=True``) streams everything a whole answer carries
(OpenAI: the usage chunk, prompt logprobs); ``whole()`` feeds it the Outputs in the order they
came and folds what it made. No API builds a whole body any other way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.messages import Output

Chunk = Any  # a msgspec Struct (a data event), or (name, payload) for an SSE event with a name


class Shaper(Protocol):
    def opening(self) -> list[Chunk]: ...

    def chunks(self, out: Output, index: int = 0) -> list[Chunk]: ...

    def stream_error(self, e: ApiError) -> list[Chunk]: ...

    def closing(self) -> bytes: ...

    def plain(self, index: int) -> bool: ...

    def fold(self, chunks: list[Chunk]) -> msgspec.Struct | dict[str, Any]: ...


def whole(shaper: Shaper, outputs: Iterable[tuple[int, Output]]) -> msgspec.Struct | dict:
    """The whole answer: the fold of the stream these (choice, Output) pairs make."""
    chunks = shaper.opening()
    for index, out in outputs:
        chunks.extend(shaper.chunks(out, index))
    return shaper.fold(chunks)


@dataclass(frozen=True, slots=True)
class Counts:
    """A request's token counts, from its choices' final Outputs: each API says them in its
    own words (OpenAI's usage, the Responses API's, Anthropic's)."""

    prompt: int  # prompt tokens (a prompt counted once, whatever its n)
    completion: int  # generated tokens, every choice's
    cached: int  # prompt tokens the prefix cache held

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def counts(finals: Sequence[Output], n: int = 1) -> Counts:
    """The choices' final Outputs, in choice order, ``n`` per prompt (a prompt's tokens count
    once, as OpenAI's n does), over a batch of prompts."""
    firsts = finals[::n]
    return Counts(sum(o.prompt_tokens for o in firsts), sum(o.completion_tokens for o in finals),
                  sum(o.cached_tokens for o in firsts))


def logprob_entries(outs: Iterable[Output]) -> int:
    """Logprob entries these Outputs carry: the cost of shaping them into JSON (a prompt
    position counts its alternatives: the whole vocabulary with prompt_logprobs=-1)."""
    n = 0
    for o in outs:  # (a loop, not nested generators: a stream asks once per batch it sends)
        n += len(o.tokens)
        if o.prompt_logprobs:
            n += sum(1 + len(t.top) for t in o.prompt_logprobs if t)
    return n
