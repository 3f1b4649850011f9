"""Sampling parameters of one request (pure Python: the control plane imports this).

Validation raises ``ValueError`` whose first word is the offending field, so the HTTP layer can
answer 400 with ``param`` set.
"""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen one)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        else:
            stop = tuple(stop)
        msgspec.structs.force_setattr(self, "stop", stop)
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"stop takes at most 16 strings, got {len(self.stop)}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit seed for draw number ``step`` of a request (splitmix64 finalizer).

    Depends only on the request's seed and how many tokens it has drawn, so a seeded request
    draws the same tokens whatever it is batched with.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1
