"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

One token budget, no prefill/decode modes. Each step:

0. when max_num_seqs are running and the head of the queue has a higher priority than the
   lowest running one, that one (the newest of the lowest priority) is preempted for it; so
   it is when blocks are short (step 2).
1. running sequences, highest priority first, then oldest, each get what they still need (1
   token for a decode, the rest of the prompt, or a budget-capped chunk of it). When the pool
   is dry the last of them (lowest priority, newest) is preempted: its blocks are released
   and it goes back to the waiting queue in its old place, to be recomputed later (its output
   so far is kept; its full blocks stay in the prefix cache, so the recompute is often mostly
   cache hits).
2. waiting sequences in the same order (priority, then arrival) while budget, max_num_seqs and
   blocks allow (after a preemption, only those that outrank a running sequence); each first
   takes its cached prefix, and one that finds no blocks preempts lower-priority running
   ones. Within the highest waiting priority, tenants take turns by served tokens (a virtual token counter, as
   in VTC, Sheng et al. 2024): the next sequence is the oldest of the tenant served least, so
   a tenant flooding the queue cannot starve another of the same priority. A tenant that was
   idle starts from the least-served active tenant's count (no credit for idle time).

Both lists stay sorted by ``_order``: (-priority, seq_id), and seq ids grow with arrival.

A sequence that fits max_model_len always fits an empty pool (the config checks
num_blocks * block_size >= max_model_len, or with a window on every layer, that the pool
holds a window and two steps: ``kv_manager.min_kv_blocks``), so preemption always ends
and nothing is lost.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

from tinyserve.config import SpeculativeConfig
from tinyserve.core import stopping
from tinyserve.core.kv_manager import KVCacheManager, min_kv_blocks
from tinyserve.core.lora_slots import LoraSlots
from tinyserve.core.plan_entries import plan_entry, verify_entry
from tinyserve.core.sequence import SeqStatus, Sequence
from tinyserve.core.speculation import Speculator
from tinyserve.messages import FieldError, ScheduledSeq, SeqFault, SeqOutput, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    max_loras: int = 0  # LoRA adapters on the device at once (0: none served)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _order(seq: Sequence) -> tuple[int, int]:
    return -seq.priority, seq.seq_id


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager) -> None:
        need = min_kv_blocks(cfg.max_model_len, kv.block_size, kv.window,
                             cfg.max_num_batched_tokens)
        if kv.pool.num_blocks < need:
            what = f"max_model_len {cfg.max_model_len}" if kv.window is None else (
                f"a window of {kv.window} and two steps of {cfg.max_num_batched_tokens} tokens")
            raise ValueError(f"the KV pool holds {kv.pool.num_blocks} blocks, fewer than {need} "
                             f"for {what}: one long request could never run. Add KV blocks or "
                             "lower max_model_len.")
        self.cfg = cfg
        self.kv = kv
        self.waiting: list[Sequence] = []  # both sorted by _order
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._step_id = 0
        self.num_preemptions = 0
        self._freed: list[int] = []  # released sequences the runner still holds a table row for
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (not cache hits)
        # The SLO controller may lower both (SloController.scheduler_limits).
        self.max_running = cfg.max_num_seqs
        self.max_tokens_per_step = cfg.max_num_batched_tokens
        self.served: dict[str, int] = {}  # tenant -> tokens scheduled for it (virtual counter)
        self._active: Counter[str] = Counter()  # tenant -> its unfinished sequences
        self.lora_slots = LoraSlots(cfg.max_loras) if cfg.max_loras else None
        self.spec = None if cfg.speculative is None else Speculator(cfg.speculative)

    # -- requests ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id}")
        if not seq.prompt_token_ids:
            raise FieldError("prompt", "prompt: must contain at least one token")
        if seq.num_tokens >= self.cfg.max_model_len:
            raise FieldError("prompt", f"prompt: {seq.num_tokens} tokens leave no room to "
                             f"generate within max_model_len {self.cfg.max_model_len}")
        seq.stop_ids, seq.token_limit = stopping.limits(
            seq.params, len(seq.prompt_token_ids), self.cfg.eos_token_ids, self.cfg.max_model_len)
        self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=_order)
        if not self._active[seq.tenant]:  # (re)joining: no credit for the time it was idle
            floor = min((self.served[t] for t, n in self._active.items() if n), default=0)
            self.served[seq.tenant] = max(self.served.get(seq.tenant, 0), floor)
        self._active[seq.tenant] += 1

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.num_inflight = seq.num_pending = 0
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        self._active[seq.tenant] -= 1

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        budget = self.max_tokens_per_step
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        while (self.waiting and len(self.running) >= self.max_running
               and self.waiting[0].priority > self.running[-1].priority):
            self._preempt(self.running.pop())  # make room for a higher priority

        drafts: dict[int, tuple[int, ...]] = {}  # speculating sequences' proposals
        may_speculate = self.spec is not None and len(self.running) <= \
            self.spec.cfg.disable_by_batch_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._to_compute(seq), budget)
            if n <= 0:  # all of it is in flight, or the step in flight is its last
                i += 1
                continue
            if n == 1 and may_speculate and (d := self.spec.propose(
                    seq, budget, self.cfg.max_model_len)):
                drafts[seq.seq_id] = d
                n += len(d)
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()  # the lowest priority, newest
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chosen.append((seq, n))
                budget -= n
                i += 1

        no_slot: set[int] = set()  # waiting sequences whose adapter found no slot this step
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self._next_waiting(no_slot)
            if seq is None:
                break
            if preempted and not self._outranks(seq):
                break  # blocks are short: only a higher priority may take them this step
            if seq.adapter is not None and seq.lora_slot < 0 and not self._take_slot(seq):
                no_slot.add(seq.seq_id)  # every slot is held: others go ahead of it
                continue
            if not seq.block_ids:
                self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, n):
                if not self._outranks(seq):
                    break
                victim = self.running.pop()  # the lowest priority, newest: its blocks go
                self._preempt(victim)
                preempted = True
                for j, (other, k) in enumerate(chosen):
                    if other is victim:  # its share of this step is void with its blocks
                        del chosen[j]
                        budget += k
                        break
            else:
                self.waiting.remove(seq)
                if seq.num_preemptions == 0:
                    self.kv.record_admission(seq)
                seq.status = SeqStatus.RUNNING
                bisect.insort(self.running, seq, key=_order)
                chosen.append((seq, n))
                budget -= n
                continue
            self._release(seq)  # give back the prefix references until blocks free up
            break

        if not chosen:
            return None
        self._step_id += 1
        seqs = tuple(self._plan_entry(s, n, drafts.get(s.seq_id, ())) for s, n in chosen)
        freed, self._freed = tuple(self._freed), []
        loads = self.lora_slots.take_loads() if self.lora_slots is not None else ()
        return StepPlan(step_id=self._step_id, seqs=seqs, freed=freed, lora_loads=loads)

    def _outranks(self, seq: Sequence) -> bool:
        """A running sequence of lower priority exists (the last one), whose blocks it may take."""
        return bool(self.running) and self.running[-1].priority < seq.priority

    def _next_waiting(self, skip: set[int] = frozenset()) -> Sequence | None:
        """The oldest waiting sequence of the least-served tenant at the top priority, of
        those not in ``skip`` (None: none left).

        O(waiting) when several tenants wait; the queue is bounded by max_waiting."""
        head = best = None
        for seq in self.waiting:  # sorted: each tenant's oldest comes before its newer ones
            if seq.seq_id in skip:
                continue
            if head is None:
                head = best = seq
            elif seq.priority != head.priority:
                break
            elif self.served[seq.tenant] < self.served[best.tenant]:
                best = seq
        return best

    def _take_slot(self, seq: Sequence) -> bool:
        """Its adapter's device slot (loaded with the next plan if not resident)."""
        a = seq.adapter
        slot = self.lora_slots.acquire(a.adapter_id, a.path, a.scale)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _drop_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.adapter.adapter_id)
            seq.lora_slot = -1

    def _to_compute(self, seq: Sequence) -> int:
        """Tokens a running sequence still needs computed, beyond those in flight; 0 when the
        steps in flight will already finish it by length (max_tokens, max_model_len)."""
        if seq.verifying:  # how far it gets is known only when the verify returns
            return 0
        total = len(seq.token_ids) + seq.num_pending
        if seq.num_pending and (total - len(seq.prompt_token_ids) >= seq.params.max_tokens
                                or total >= self.cfg.max_model_len):
            return 0
        return total - seq.num_computed_tokens - seq.num_inflight

    def _plan_entry(self, seq: Sequence, n: int, drafts: tuple[int, ...] = ()) -> ScheduledSeq:
        """Its share of the step (plan_entries.py), and what the step counts for it."""
        start = seq.num_computed_tokens + seq.num_inflight
        self.served[seq.tenant] += n
        if start < len(seq.prompt_token_ids):  # (a verify's first position may be the last
            k = 1 if drafts else n               # prompt token: a 1-token last chunk)
            self.num_prompt_tokens_computed += min(start + k, len(seq.prompt_token_ids)) - start
        if drafts:
            return verify_entry(seq, drafts, self.cfg.eos_token_ids)
        return plan_entry(seq, n, self.cfg.eos_token_ids)

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's blocks (and its adapter slot); the runner drops its block-table
        row with the next plan."""
        self._drop_slot(seq)
        self.kv.free(seq)
        if seq.blocks_sent:
            self._freed.append(seq.seq_id)
            seq.blocks_sent = 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_inflight = seq.num_pending = 0  # (results of steps in flight are now stale)
        seq.draft_len, seq.verifying = 0, False  # (its blocks, the draft's too, are gone)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_order)
        log.debug("preempted seq %d (%d tokens)", seq.seq_id, seq.num_tokens)

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply a step's results; returns the sequences that got a token or failed with it.

        Sequences finished, aborted or preempted while the step ran are skipped: their blocks
        were released and the result no longer applies to them. Steps are applied in the order
        they were planned.
        """
        live: dict[int, Sequence] = {}
        verifies: dict[int, ScheduledSeq] = {}
        updated = []
        prompt_lps = {pl.seq_id: pl for pl in result.prompt_logprobs}
        faults = {f.seq_id: f for f in result.faults} if result.faults else None
        seqs, running, kv = self.seqs, SeqStatus.RUNNING, self.kv  # (per sequence: kept lean)
        commit = kv.commit if kv.enable_prefix_caching else None
        drop = kv.drop_behind_window if kv.window is not None else None
        for s in plan.seqs:
            seq = seqs.get(s.seq_id)
            if seq is None or seq.status is not running or seq.num_preemptions != \
                    s.epoch or seq.num_computed_tokens != s.start_pos:
                continue
            seq.num_new = 0
            if result.error is not None:  # the step's KV writes are suspect: end, don't retry
                self.finish(seq, "error")
                updated.append(seq)
                continue
            if faults is not None and s.seq_id in faults:  # its own fault: nothing counts
                self._fault(seq, faults[s.seq_id])
                updated.append(seq)
                continue
            n = len(s.token_ids)
            seq.num_inflight -= n
            if s.num_drafts:  # a verify: computed as far as its draws agree (below)
                seq.verifying = False
                verifies[seq.seq_id] = s
                live[seq.seq_id] = seq
                seq.num_pending -= 1
                continue
            seq.num_computed_tokens += n
            if commit is not None:
                commit(seq)
            if drop is not None:
                drop(seq)
            if s.prompt_targets and (pl := prompt_lps.get(s.seq_id)) is not None:
                have = len(seq.prompt_lps) - pl.start_pos  # (a recompute brings some again)
                if have >= 0:
                    seq.prompt_lps.extend(pl.entries[have:])
            if s.sample:
                seq.num_pending -= 1
                live[seq.seq_id] = seq
        for out in result.outputs:
            seq = live.get(out.seq_id)
            if seq is None:
                continue
            if out.error is not None:  # its constraints cannot go on: no token, an error
                seq.error = (out.error_reason, out.error)
                self.finish(seq, "error")
            elif not out.more and not verifies:  # one token: the common case, inline
                token = out.token_id
                seq.token_ids.append(token)
                seq.num_new = 1
                if seq.params.logprobs is not None:
                    seq.logprobs.append((out.logprob, out.top_logprobs))
                if (reason := stopping.after_token(seq, token)) is not None:
                    self.finish(seq, reason)
            else:
                self._apply_draws(seq, out, verifies.get(seq.seq_id))
            updated.append(seq)
        return updated

    def _fault(self, seq: Sequence, fault: SeqFault) -> None:
        """A fault of its own (engine/running/faults.py) ends it with the error; an adapter
        that could not be loaded leaves its slot, so the next request on it loads it anew."""
        seq.error = (fault.reason, fault.message)
        if fault.reason == "adapter" and seq.adapter is not None and self.lora_slots:
            self.lora_slots.invalidate(seq.adapter.adapter_id)
        self.finish(seq, "error")

    def _apply_draws(self, seq: Sequence, out: SeqOutput, verify: ScheduledSeq | None) -> None:
        """A step's several tokens for one sequence (a verify's draws), up to a stop; its KV
        is then valid through the last position whose draw agreed (a draft model's through
        the last draft it was fed that was accepted)."""
        seq.num_new = 0
        for token, lp, top in ((out.token_id, out.logprob, out.top_logprobs), *out.more):
            seq.token_ids.append(token)
            seq.num_new += 1
            if seq.params.logprobs is not None:
                seq.logprobs.append((lp, top))
            reason = stopping.after_token(seq, token)
            if reason is not None:  # (a verify's tokens after it are dropped)
                self.finish(seq, reason)
                break
        if verify is not None and not seq.is_finished:
            self.spec.record(seq, verify.num_drafts, len(out.more))
            seq.draft_len = verify.start_pos + 1 + min(len(out.more), verify.num_drafts - 1)
            seq.num_computed_tokens += 1 + len(out.more)
            self.kv.commit(seq)
            self.kv.drop_behind_window(seq)
        elif verify is not None:  # accepted: the drafts it emitted before it stopped
            self.spec.record(seq, verify.num_drafts, min(len(out.more), seq.num_new))
