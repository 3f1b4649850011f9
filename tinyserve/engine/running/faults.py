"""A request's own fault fails that request, never its neighbours in the step.

Three faults are a request's own, and the runner ends only its sequences for them (each a
SeqFault in the StepResult; the batcher answers that request with the error):

    adapter     its LoRA adapter could not be read into its slot (the file changed or went
                away after the load checked it): the slot is marked empty, so nothing ever
                runs on what it held before, and every sequence planned on it is left out
    invalid     the step raised, and the sequence has what can make a step raise: a token id
                outside the vocabulary, a parameter that overflows its staging type, logits
                that are not finite; the step runs once more without those sequences
    non_finite  its logits were NaN or infinite (step_outputs.py): found after the draw

A sequence ended so is left out of every later plan the runner sees until the scheduler frees
it (a plan made ahead may still carry it). Owned by the ModelRunner, on the step thread.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from tinyserve.messages import DRAFT, PLACEHOLDER, ScheduledSeq, SeqFault, StepPlan

log = logging.getLogger(__name__)

MAX_REMEMBERED = 1 << 16  # ended sequences kept to leave out (freed ones are dropped at once)
_INT32, _INT64 = 1 << 31, 1 << 63


class StepFaults:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ended: dict[int, None] = {}  # seq ids ended by a fault, oldest first
        self._slot_errors: dict[int, str] = {}  # LoRA slot -> why its last load failed

    def start(self, plan: StepPlan, stacks: Any, host: Any) -> dict[int, tuple[str, str]]:
        """Before a step: its adapter loads (a failed one empties its slot), and the faults
        of the sequences planned on an empty slot. Returns seq id -> (reason, message)."""
        for seq_id in plan.freed:
            self._ended.pop(seq_id, None)
        for load in plan.lora_loads:
            try:
                stacks.load(load.slot, host.get(load.adapter_id, load.path, load.scale))
                self._slot_errors.pop(load.slot, None)
            except Exception as e:  # noqa: BLE001 (any failure: the slot holds nothing sound)
                stacks.resident[load.slot] = None
                self._slot_errors[load.slot] = str(e)
                log.error("LoRA adapter %d could not be loaded into slot %d: %s",
                          load.adapter_id, load.slot, e)
        faults = {}
        if self._slot_errors:
            for s in plan.seqs:
                why = self._slot_errors.get(s.lora_slot) if s.lora_slot >= 0 else None
                if why is not None:
                    faults[s.seq_id] = ("adapter", f"its LoRA adapter could not be loaded: {why}")
        self._remember(faults)
        return faults

    def runnable(self, seqs: tuple[ScheduledSeq, ...]) -> tuple[ScheduledSeq, ...] | list:
        if not self._ended:
            return seqs
        return [s for s in seqs if s.seq_id not in self._ended]

    def blame(self, seqs: list[ScheduledSeq],
              sampling: tuple[torch.Tensor, list[ScheduledSeq]] | None
              ) -> dict[int, tuple[str, str]]:
        """After a step raised: the sequences that explain it (host checks only: this runs
        only when a step failed)."""
        blamed = {}
        for s in seqs:
            why = self._why(s)
            if why is not None:
                blamed[s.seq_id] = ("invalid", why)
        if sampling is not None:  # it raised in or after the draw: non-finite rows
            logits, rows = sampling
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            for ok, s in zip(finite, rows, strict=False):
                if not ok and s.seq_id not in blamed:
                    blamed[s.seq_id] = ("non_finite", "the model's logits for this request "
                                        "were NaN or infinite")
        self._remember(blamed)
        return blamed

    def ended(self, faults: dict[int, tuple[str, str]], poisoned: tuple[SeqFault, ...]
              ) -> tuple[SeqFault, ...]:
        """A finished step's faults: those found at launch and the non-finite draws."""
        if not faults and not poisoned:
            return ()
        self._remember({f.seq_id: None for f in poisoned})
        return tuple(SeqFault(i, reason, why) for i, (reason, why) in faults.items()) + poisoned

    def _why(self, s: ScheduledSeq) -> str | None:
        V = self.vocab_size
        ids = [t for t in s.token_ids if t not in (PLACEHOLDER, DRAFT)]
        for name, group in (("token", ids), ("output token", s.output_ids or ()),
                            ("prompt token", s.prompt_ids or ()), ("banned token", s.banned),
                            ("logit_bias token", [t for t, _ in s.params.logit_bias]),
                            ("stop token", s.params.stop_token_ids)):
            bad = next((t for t in group if not 0 <= t < V), None)
            if bad is not None:
                return f"{name} id {bad} is out of the vocabulary (0-{V - 1})"
        p = s.params
        if not -_INT64 <= s.seed < _INT64 or any(not -_INT64 <= x < _INT64
                                                 for x in s.spec_seeds):
            return f"the seed {s.seed} does not fit 64 bits"
        if p.top_k >= _INT32:
            return f"top_k {p.top_k} does not fit 32 bits"
        if (p.logprobs or 0) > V or (p.prompt_logprobs or 0) > V:
            return f"logprobs {p.logprobs} / {p.prompt_logprobs} exceed the vocabulary ({V})"
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(p, name)):
                return f"{name} {getattr(p, name)} is not a finite number"
        return None

    def _remember(self, seq_ids: dict) -> None:
        for seq_id in seq_ids:
            self._ended[seq_id] = None
        while len(self._ended) > MAX_REMEMBERED:
            self._ended.pop(next(iter(self._ended)))
