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
from typing import TYPE_CHECKING

from tinyserve.core.spec_state import NgramIndex
from tinyserve.messages import DRAFT

if TYPE_CHECKING:  # (a sequence holds its speculation state from spec_state.py: no circle)
    from tinyserve.core.sequence import Sequence

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


class Speculator:
    """The scheduler's proposer and tallies: draft tokens for a decode with nothing in
    flight (every token known), and how many of them verify steps accepted."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.num_verifies = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_at = [0] * cfg.num_speculative_tokens  # by draft position

    def propose(self, seq: Sequence, budget: int, max_model_len: int) -> tuple[int, ...]:
        """Up to K drafts, bounded by what the request may still generate, the context and
        the step's token budget; () when it should not speculate now."""
        cfg = self.cfg
        if seq.num_pending or seq.num_inflight or not seq.acceptance.worth_it(
                cfg.min_acceptance):
            return ()
        room = min(cfg.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                   max_model_len - seq.num_tokens - 1, budget - 1)
        if room <= 0:
            return ()
        if cfg.method == "draft_model":  # proposed on the device, before the verify runs
            return (DRAFT,) * room
        if seq.ngram is None:
            seq.ngram = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return seq.ngram.propose(seq.token_ids, room)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.acceptance.record(accepted, proposed)
        self.num_verifies += 1
        self.num_draft_tokens += proposed
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def totals(self) -> tuple[int, int, int, tuple[int, ...]]:
        return (self.num_verifies, self.num_draft_tokens, self.num_accepted,
                tuple(self.accepted_at))
