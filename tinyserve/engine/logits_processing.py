"""Host side of logits processing: the per-row token lists the penalties kernel reads.

One row per sampled sequence; a row lists each distinct token it touches once:

    its output tokens (with counts)          presence / frequency / repetition penalties
    its prompt tokens (repetition only)      vLLM's repetition penalty counts the prompt too
    its logit_bias keys                       -100 bans (-inf), other biases add
    its banned ids (min_tokens)               -inf

Rows that process nothing list nothing (rep 1, no penalties): the kernel leaves them alone.
Cost: O(output + prompt + bias) per processed row per step, numpy only; paid only by requests
that ask for it (SamplingParams.penalized).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyserve.messages import ScheduledSeq

_EMPTY = np.zeros(0, np.int64)


class PenaltyLists:
    """tokens [B, L] int32 (-1 pads), counts, in_prompt [B, L] int32, bias [B, L] fp32;
    rep, freq, pres [B] fp32."""

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                 rep: list[float], freq: list[float], pres: list[float]) -> None:
        B, L = len(rows), max((len(r[0]) for r in rows), default=0)
        self.tokens = np.full((B, L), -1, np.int32)
        self.counts = np.zeros((B, L), np.int32)
        self.in_prompt = np.zeros((B, L), np.int32)
        self.bias = np.zeros((B, L), np.float32)
        for i, (tok, cnt, inp, bias) in enumerate(rows):
            n = len(tok)
            self.tokens[i, :n], self.counts[i, :n] = tok, cnt
            self.in_prompt[i, :n], self.bias[i, :n] = inp, bias
        self.rep = np.asarray(rep, np.float32)
        self.freq = np.asarray(freq, np.float32)
        self.pres = np.asarray(pres, np.float32)


def _row(s: ScheduledSeq) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    p = s.params
    out = np.asarray(s.output_ids or (), np.int64)
    out = out[out >= 0]  # (a placeholder nobody filled: only if a plan skipped the executor)
    out_ids, out_counts = np.unique(out, return_counts=True) if out.size else (_EMPTY, _EMPTY)
    prompt = np.unique(np.asarray(s.prompt_ids, np.int64)) if s.prompt_ids else _EMPTY
    bias_ids = np.fromiter((t for t, _ in p.logit_bias), np.int64, len(p.logit_bias))
    bias_vals = np.fromiter((b for _, b in p.logit_bias), np.float32, len(p.logit_bias))
    banned = np.asarray(s.banned, np.int64)
    ids = np.unique(np.concatenate([out_ids, prompt, bias_ids, banned]))
    counts = np.zeros(len(ids), np.int32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    in_prompt = np.zeros(len(ids), np.int32)
    in_prompt[np.searchsorted(ids, prompt)] = 1
    bias = np.zeros(len(ids), np.float32)
    # OpenAI: -100 "should result in a ban"; vLLM adds it. A ban is exact here.
    bias[np.searchsorted(ids, bias_ids)] = np.where(bias_vals <= -100.0, -np.inf, bias_vals)
    bias[np.searchsorted(ids, banned)] = -np.inf
    return ids, counts, in_prompt, bias


def penalty_lists(seqs: Sequence[ScheduledSeq]) -> PenaltyLists | None:
    """The lists for one step's sampled sequences (None: no row lists anything)."""
    if not any(s.params.penalized for s in seqs):
        return None
    none = (_EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.float32))
    rows = [_row(s) if s.params.penalized else none for s in seqs]
    if not any(len(r[0]) for r in rows):  # e.g. a presence penalty before any output
        return None
    return PenaltyLists(rows, [s.params.repetition_penalty for s in seqs],
                        [s.params.frequency_penalty for s in seqs],
                        [s.params.presence_penalty for s in seqs])
