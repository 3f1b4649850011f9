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

from typing import TYPE_CHECKING

from tinyserve.config import SpeculativeConfig
from tinyserve.core.spec_state import NgramIndex
from tinyserve.messages import DRAFT

if TYPE_CHECKING:  # (a sequence holds its speculation state from spec_state.py: no circle)
    from tinyserve.core.sequence import Sequence

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
