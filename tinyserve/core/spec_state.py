"""A sequence's own speculation state (core/speculation.py decides with it): its n-gram
index over prompt and output, and its running acceptance."""

from __future__ import annotations

from dataclasses import dataclass


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, kept as tokens are appended, so a
    proposal costs O(prompt_lookup_max) a step, not O(history).

        tokens   a b c d a b c    the suffix "a b c" last occurred ending at index 2:
        propose  d a b ...        the tokens that followed it (up to K)
    """

    __slots__ = ("n_min", "n_max", "_ends", "_seen")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # n-gram -> the index of its last token, where it last ended before the newest one
        self._ends: dict[tuple[int, ...], int] = {}
        self._seen = 0  # tokens indexed

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the longest recent match of the tokens' suffix."""
        self._catch_up(tokens)
        n_tokens = len(tokens)
        for n in range(min(self.n_max, n_tokens - 1), self.n_min - 1, -1):
            end = self._ends.get(tuple(tokens[n_tokens - n:]))
            if end is not None and end < n_tokens - 1:
                return tuple(tokens[end + 1:end + 1 + k])
        return ()

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams ending at each token not seen yet, except the newest (a match
        must end before the suffix it matches). O(new tokens x n_max)."""
        ends = self._ends
        for i in range(self._seen, len(tokens) - 1):
            for n in range(self.n_min, self.n_max + 1):
                if i + 1 >= n:
                    ends[tuple(tokens[i + 1 - n:i + 1])] = i
        self._seen = max(self._seen, len(tokens) - 1)


@dataclass(slots=True)
class Acceptance:
    """A request's running mean of accepted draft tokens per proposed, and whether it still
    speculates (below SpeculativeConfig.min_acceptance after a few steps, it stops)."""

    mean: float = 1.0
    steps: int = 0

    def record(self, accepted: int, proposed: int) -> None:
        if proposed:
            self.steps += 1
            self.mean += (accepted / proposed - self.mean) / min(self.steps, 8)

    def worth_it(self, min_acceptance: float) -> bool:
        return self.steps < 4 or self.mean >= min_acceptance
