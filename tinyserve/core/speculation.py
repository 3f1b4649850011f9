"""Speculative decoding, the control plane's part: the configuration (vLLM's
``--speculative-config``), the n-gram proposer, and when to speculate.

A speculating decode proposes K tokens d1..dK; the step computes positions p..p+K with
inputs [t_p, d1, ..., dK] and draws a token at every one of them, each draw exactly as plain
decoding would draw it (its own seed mix_seed(seed, drawn + i), the history up to it for
penalties and the grammar). Proposals are point masses (the n-gram's continuation, a draft
model's argmax), so rejection sampling (accept d with min(1, q(d) / p(d)) = q(d), else draw
from q with d removed) is the same as: draw x_i ~ q_i; accept d_{i+1} while x_i == d_{i+1};
at the first mismatch emit x_i (the residual's draw), and after K accepts the bonus x_K. The
emitted tokens are then the ones plain decoding would have drawn: greedy and seeded sampling
give the same output with speculation as without (as far as the verify step's logits equal
the decode step's).

    positions   p     p+1   p+2   p+3          (K = 3)
    inputs      t_p   d1    d2    d3
    draws       x0    x1    x2    x3           x0 == d1, x1 == d2, x2 != d3
    emitted     x0    x1    x2                 3 tokens from one forward pass; KV valid to p+2

Rejected positions' KV is never read: the sequence's length advances by the emitted count,
and positions past it are written again, with the right tokens, before anything reads them;
prefix hashes cover computed tokens only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
REFUSED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                   "ernie_mtp", "qwen3_next_mtp", "suffix")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # n-gram: the longest suffix looked up in the history
    prompt_lookup_min: int = 2  # ... the shortest
    model: str | None = None  # draft_model: its checkpoint (same tokenizer as the target)
    quantization: str | None = None  # draft_model: its weights' format (int4: a cheap self-draft)
    # No speculation in steps with more running sequences than this (on a full batch a
    # verify step costs more than it saves)
    disable_by_batch_size: int = 8
    # A request whose draft tokens are accepted less than this often (a running mean over
    # its verify steps) stops speculating: its proposals are not paying for their positions
    min_acceptance: float = 0.1

    def __post_init__(self) -> None:
        if self.method in REFUSED_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported: it "
                             "needs a trained head; ngram and draft_model are")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max <= 32")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: a draft_model needs its checkpoint")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is for method draft_model")
        if self.disable_by_batch_size < 1 or not 0 <= self.min_acceptance < 1:
            raise ValueError("speculative_config: disable_by_batch_size >= 1 and "
                             "min_acceptance in [0, 1)")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'``."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("--speculative-config: expected a JSON object")
    fields = set(SpeculativeConfig.__dataclass_fields__)
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)} (known: "
                         f"{', '.join(sorted(fields))})")
    return SpeculativeConfig(**d)


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
