"""A launched step (what ``ModelRunner.finish`` needs) and its result once its tokens are
on the host: the one place a step's sampled tokens become SeqOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyserve.engine.running.logits_processing import LogitsProcessors
from tinyserve.engine.running.staging import Readback
from tinyserve.messages import PromptLogprobs, ScheduledSeq, SeqFault, SeqOutput

NON_FINITE = ("non_finite", "the model's logits for this request were NaN or infinite (its "
              "adapter's weights or its inputs overflow); it was ended, nothing else was")


@dataclass(slots=True)
class Launched:
    """A step queued on the device: what ``finish`` needs to shape its result."""

    step_id: int
    t0: float
    sampled: list[ScheduledSeq] = field(default_factory=list)  # the rows that draw a token
    masks: np.ndarray | None = None  # their grammar masks (host)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # rows whose grammar failed
    readback: Readback | None = None  # tokens, logprobs, top ids, top logprobs[, expert load]
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    faults: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq id -> (reason, why)

    def ready(self) -> bool:
        """Its tokens are on the host (``finish`` will not wait)."""
        return self.readback is None or self.readback.ready


def step_outputs(launched: Launched, logits: LogitsProcessors
                 ) -> tuple[tuple[SeqOutput, ...], tuple[SeqFault, ...]]:
    """A finished step's sampled rows as SeqOutputs (its one host sync: the readback); a
    verify's rows (packing.verify_rows) become one SeqOutput with its agreeing draws. A
    sequence whose logits were not finite (its logprob is NaN: the sampling kernel's
    logsumexp takes every allowed logit) becomes a SeqFault instead; the other rows go on."""
    seqs, masks = launched.sampled, launched.masks
    tokens, logprobs, top_ids, top_lps = launched.readback.wait()[:4]  # (5th: expert load)
    tokens_l, lps_l = tokens.tolist(), logprobs.tolist()
    # A row whose constraints leave nothing drew a banned token: it ends instead, with
    # EOS where the request allows it, else with an error (never the banned token).
    ends = logits.dead_ends(seqs, masks, launched.failed)
    for i, end in ends.items():
        tokens_l[i] = end if isinstance(end, int) else -1
    poisoned = _poisoned(seqs, lps_l, ends)
    if masks is not None:  # (a verify's matcher is caught up by its next step's history)
        plain = [i for i, s in enumerate(seqs) if not s.num_drafts and i not in poisoned]
        logits.advance([seqs[i] for i in plain], [tokens_l[i] for i in plain])
    tops = None if top_ids is None else list(zip(top_ids.tolist(), top_lps.tolist(),
                                                 strict=True))

    def draw(i: int) -> tuple[int, float, tuple[tuple[int, float], ...] | None]:
        p = seqs[i].params
        top = None if p.logprobs is None else ()
        if tops is not None and p.logprobs is not None:
            ids, lps = tops[i]
            top = tuple(zip(ids[: p.logprobs], lps[: p.logprobs], strict=True))
        return tokens_l[i], lps_l[i], top

    out, faults = [], []
    i = 0
    while i < len(seqs):
        s = seqs[i]
        if i in poisoned:
            faults.append(SeqFault(s.seq_id, *NON_FINITE))
            i += 1 + s.num_drafts
            continue
        rows = _agreeing(s, tokens_l, ends, i) if s.num_drafts else 1
        end = ends.get(i)
        if rows == 0 or (end is not None and not isinstance(end, int)):
            out.append(SeqOutput(s.seq_id, -1, 0.0, error=end[1], error_reason=end[0]))
        else:
            first, *more = (draw(r) for r in range(i, i + rows))
            out.append(SeqOutput(s.seq_id, *first, more=tuple(more)))
        i += 1 + s.num_drafts
    return tuple(out), tuple(faults)


def _poisoned(seqs: list[ScheduledSeq], logprobs: list[float], ends: dict) -> set[int]:
    """The first rows of the sequences with a NaN logprob in any of their rows (a row that
    ended for its constraints aside: everything masked is NaN too)."""
    bad = [i for i, lp in enumerate(logprobs) if lp != lp and i not in ends]
    if not bad:
        return set()
    first, starts = set(), []
    i = 0
    while i < len(seqs):  # (a verify's rows follow its first)
        starts.append(i)
        i += 1 + seqs[i].num_drafts
    for row in bad:
        first.add(max(j for j in starts if j <= row))
    return first


def _agreeing(s: ScheduledSeq, tokens: list[int], ends: dict, i: int) -> int:
    """How many of a verify's rows (from row i) become tokens: its draws while each equals
    the next draft, then the first that does not (or the bonus after the last draft); cut
    before a row that ends in an error, through a row that ends with EOS. 0: row 0 failed."""
    drafts = s.token_ids[1:]
    n = s.num_drafts + 1
    for r in range(s.num_drafts):
        if tokens[i + r] != drafts[r]:
            n = r + 1
            break
    for r in range(n):
        end = ends.get(i + r)
        if end is not None:
            return r + 1 if isinstance(end, int) else r
    return n
