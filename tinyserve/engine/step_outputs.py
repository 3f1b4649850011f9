"""A launched step (what ``ModelRunner.finish`` needs) and its result once its tokens are
on the host: the one place a step's sampled tokens become SeqOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyserve.engine.logits_processing import LogitsProcessors
from tinyserve.engine.staging import Readback
from tinyserve.messages import PromptLogprobs, ScheduledSeq, SeqOutput


@dataclass(slots=True)
class Launched:
    """A step queued on the device: what ``finish`` needs to shape its result."""

    step_id: int
    t0: float
    sampled: list[ScheduledSeq] = field(default_factory=list)  # the rows that draw a token
    masks: np.ndarray | None = None  # their grammar masks (host)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # rows whose grammar failed
    readback: Readback | None = None  # tokens, logprobs, top ids, top logprobs
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()

    def ready(self) -> bool:
        """Its tokens are on the host (``finish`` will not wait)."""
        return self.readback is None or self.readback.ready


def step_outputs(launched: Launched, logits: LogitsProcessors) -> tuple[SeqOutput, ...]:
    """A finished step's sampled rows as SeqOutputs (its one host sync: the readback)."""
    seqs, masks = launched.sampled, launched.masks
    tokens, logprobs, top_ids, top_lps = launched.readback.wait()
    tokens_l, lps_l = tokens.tolist(), logprobs.tolist()
    # A row whose constraints leave nothing drew a banned token: it ends instead, with
    # EOS where the request allows it, else with an error (never the banned token).
    ends = logits.dead_ends(seqs, masks, launched.failed)
    for i, end in ends.items():
        tokens_l[i] = end if isinstance(end, int) else -1
    if masks is not None:
        logits.advance(seqs, tokens_l)
    tops = None if top_ids is None else list(zip(top_ids.tolist(), top_lps.tolist(),
                                                 strict=True))
    out = []
    for i, s in enumerate(seqs):
        p = s.params
        end = ends.get(i)
        if end is not None and not isinstance(end, int):
            out.append(SeqOutput(s.seq_id, -1, 0.0, error=end[1], error_reason=end[0]))
            continue
        top = None if p.logprobs is None else ()
        if tops is not None and p.logprobs is not None:
            ids, lps = tops[i]
            top = tuple(zip(ids[: p.logprobs], lps[: p.logprobs], strict=True))
        out.append(SeqOutput(s.seq_id, tokens_l[i], lps_l[i], top))
    return tuple(out)
