"""ModelRunner: owns the device state (weights, KV cache, block table) and runs one StepPlan.

Two paths:
- decode buckets: a step of decodes only is padded to the next bucket size (1, 2, 4, 8, 16,
  24, 32, 48, 64, ... up to max_num_seqs) and its inputs are written into static buffers:
  one host staging buffer (pinned on a GPU), one host-to-device copy. The forward pass of
  each bucket was recorded once (kernels.utils.Recording) and is replayed as a list of
  launches - or, on a GPU, as a CUDA graph captured from that list. Padded rows compute
  garbage that is never read: token 0 at position 0, slot -1 (no KV write), length 1 in the
  padding row of the block table. Every kernel's tiles are fixed per model, so a real row's
  numbers do not change with the padding (tests compare the two paths token for token).
- eager: prefill and mixed steps (and everything with ``enforce_eager``) run the launchers
  directly with per-step tensors.

Both read the persistent block table (block_tables.py); plans carry only new blocks.

A step is ``launch``ed, then ``finish``ed (``execute`` does both): launch queues the whole
step on the device, sampling and the copy of its tokens to pinned host memory included, and
returns; finish waits for that copy and shapes the StepResult. The executor launches step N+1
before it finishes N: N+1's placeholder tokens (what N samples) are taken on the device from
N's sampled tensor (kernels/placeholders.py), every staging copy is pinned and non-blocking,
so the host's per-step work overlaps the device's and the device never waits for it. A step
whose sequences need N's tokens on the host (penalties, grammars: their output so far) is
launched after N is finished, its placeholders filled on the host (executor.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tinyserve.engine.loading.model_config import ModelConfig
from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.decoder import DecoderModel
from tinyserve.engine.model.kv_cache import KVCacheSpec, allocate_kv_cache
from tinyserve.engine.model.lora import HostAdapters
from tinyserve.engine.running.block_tables import BlockTables
from tinyserve.engine.running.buckets import DecodeBuckets, decode_buckets
from tinyserve.engine.running.draft import DraftProposer
from tinyserve.engine.running.faults import StepFaults
from tinyserve.engine.running.logits_processing import LogitsProcessors
from tinyserve.engine.running.packing import pack_arrays
from tinyserve.engine.running.staging import DecodeStatics, Readback, stage
from tinyserve.engine.running.step_outputs import Launched, step_outputs
from tinyserve.kernels import sample, update_block_table
from tinyserve.kernels.placeholders import fill_placeholders
from tinyserve.messages import (
    DRAFT,
    PLACEHOLDER,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
)

log = logging.getLogger(__name__)


# How often the expert counters (engine/model/moe.py) are copied to the host with a step's
# tokens: the load gauge's window is tens of seconds, so once a second is plenty.
EXPERT_LOAD_EVERY_S = 1.0


class ModelRunner:
    fills_on_device = True  # (core/engines.Runner) placeholders from its last step's tokens

    def __init__(self, model: DecoderModel, cfg: ModelConfig, kv_spec: KVCacheSpec,
                 device: torch.device | str, *, max_num_seqs: int = 64,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 host_adapters: HostAdapters | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.host_adapters = host_adapters  # LoRA: adapters in host memory, loaded into slots
        self.draft: DraftProposer | None = None  # speculation's draft model (DeviceEngine)
        self.kv_spec = kv_spec
        self.device = torch.device(device)
        self.kv_cache = allocate_kv_cache(kv_spec, device)
        self.max_model_len = max_model_len or model.rope.max_positions
        bs = kv_spec.block_size
        width = -(-self.max_model_len // bs)
        # Twice max_num_seqs: rows of released sequences wait for the next plan's ``freed``.
        self.tables = BlockTables(2 * max_num_seqs, width, bs)
        self.table_dev = torch.zeros((2 * max_num_seqs + 1, width), dtype=torch.int32,
                                     device=self.device)
        self.max_num_seqs = max_num_seqs
        self.buckets = DecodeBuckets(() if enforce_eager else decode_buckets(max_num_seqs),
                                     self.max_model_len, self.device,
                                     use_graphs=self.device.type == "cuda" and not enforce_eager)
        # (max_num_seqs rows also with enforce_eager: eager steps stage their sampling there)
        self.statics = DecodeStatics(max(max_num_seqs, *self.buckets.sizes, 1),
                                     max(256, 2 * width), self.device)
        # penalties, grammar masks, prompt logprobs (its ``grammars`` set by the DeviceEngine)
        self.logits = LogitsProcessors(cfg.vocab_size, cfg.eos_token_ids, self.device)
        # The last launched step's sampled tokens (device) and each sampling sequence's row in
        # them: where the next step's placeholders come from.
        self._prev: tuple[dict[int, int], torch.Tensor | None] = ({}, None)
        self._prev_tokens: torch.Tensor | None = None  # the step before the one launching
        self._sampling: tuple[torch.Tensor, list[ScheduledSeq]] | None = None
        self.faults = StepFaults(cfg.vocab_size)  # what a request's own fault ends
        self._load_read_at = 0.0  # when the expert counters next ride along a readback

    # -- one step ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Queue the step on the device (forward, sampling, the tokens' copy to the host) and
        return without waiting for it. A PLACEHOLDER input token is taken on the device from
        the last launched step's sampled tokens; a sequence that step did not sample is left
        out (the batcher has ended it).

        A request's own fault fails only that request (faults.py): a sequence whose adapter
        could not be loaded is left out; if the step raises, the sequences it can blame
        (out-of-range ids, parameters that overflow, non-finite logits) are left out and the
        step runs once more without them. Only a fault no sequence explains raises."""
        t0 = time.perf_counter()
        # Freed rows go back first; every check that can refuse the step runs before the
        # table changes (the host mirror and the device table must not part ways over it).
        self.tables.release(plan.freed)
        self.logits.forget(plan.freed)
        faults = self.faults.start(plan, self.model.lora, self.host_adapters)
        seqs = sorted(self.faults.runnable(plan.seqs), key=lambda s: len(s.token_ids) != 1)
        prev = self._prev
        try:
            launched = self._launch(plan.step_id, seqs, prev, t0)
        except Exception as e:
            blamed = self.faults.blame(seqs, self._sampling)
            if not blamed:
                raise
            log.warning("step %d raised %s: %s; ran again without %d sequence(s) it blamed",
                        plan.step_id, type(e).__name__, e, len(blamed))
            faults.update(blamed)
            launched = self._launch(plan.step_id, [s for s in seqs if s.seq_id not in blamed],
                                    prev, t0)
        launched.faults = faults
        return launched

    def _launch(self, step_id: int, seqs: list[ScheduledSeq],
                prev: tuple[dict[int, int], torch.Tensor | None], t0: float) -> Launched:
        seqs, holes = self._placeholders(seqs, prev[0])
        # (this step's once it has sampled; a step that raises leaves none behind)
        self._prev_tokens, self._prev = prev[1], ({}, None)
        self._sampling = None
        max_pos = self.model.rope.max_positions
        if seqs and max(s.start_pos + len(s.token_ids) for s in seqs) > max_pos:
            raise ValueError(f"a position is beyond the rotary table ({max_pos})")
        self.statics.writable()
        rows, updates = self.tables.apply((), seqs)
        # Buckets take decodes that all sample (a one-token prompt chunk cut short by the
        # token budget does not: that step runs eager).
        bucketed = bool(seqs) and len(seqs[-1].token_ids) == 1 \
            and len(seqs) <= (self.buckets.sizes or (0,))[-1] and all(s.sample for s in seqs)
        if bucketed:
            logits, sampled = self._decode_bucket(seqs, rows, updates, holes)
        else:
            self.push_table_updates(updates, statics=False)
            if not seqs:
                return Launched(step_id, t0)
            if self.draft is not None:
                seqs = self._with_drafts(seqs, rows)
            batch, sampled = self.pack(seqs, rows, holes)
            logits = self.model.forward(batch, self.kv_cache)
        prompt_lps = ()
        if not bucketed and any(s.prompt_targets for s in seqs):
            prompt_lps = self.logits.prompt_logprobs(logits[len(sampled):], seqs)
            logits = logits[:len(sampled)]
        self._sampling = (logits, sampled)  # (what a blame after a raise in sampling reads)
        launched = self._sample(logits, sampled, staged=bucketed)
        launched.step_id, launched.t0, launched.prompt_logprobs = step_id, t0, prompt_lps
        return launched

    def finish(self, launched: Launched) -> StepResult:
        """Wait for the step's tokens (its one host sync) and shape its result."""
        outputs, poisoned = step_outputs(launched, self.logits) if launched.sampled else ((), ())
        faults = self.faults.ended(launched.faults, poisoned)
        return StepResult(step_id=launched.step_id, outputs=outputs,
                          seconds=time.perf_counter() - launched.t0,
                          prompt_logprobs=launched.prompt_logprobs, faults=faults,
                          expert_load=self._expert_load(launched))

    def _expert_load(self, launched: Launched) -> tuple | None:
        """The expert counters where this step's readback carried them (already waited for)."""
        rb = launched.readback
        if rb is None or len(rb.host) < 5:
            return None
        return tuple(zip(self.model.expert_load.layers, map(tuple, rb.host[4].tolist()),
                         strict=True))

    def _with_drafts(self, seqs: list[ScheduledSeq], rows: list[int]) -> list[ScheduledSeq]:
        """Verify entries whose drafts the draft model proposes: proposed (the table rows
        they write the draft's KV through are on the device already)."""
        todo = [i for i, s in enumerate(seqs) if s.num_drafts and s.token_ids[1] == DRAFT]
        if not todo:
            return seqs
        done = self.draft.propose([seqs[i] for i in todo], [rows[i] for i in todo],
                                  self.tables.host, self.table_dev, self.kv_spec.block_size)
        seqs = list(seqs)
        for i, s in zip(todo, done, strict=True):
            seqs[i] = s
        return seqs

    def _placeholders(self, seqs: list[ScheduledSeq], rows_of: dict[int, int]
                      ) -> tuple[list[ScheduledSeq], dict[int, int]]:
        """(the sequences that can run, {index in them: row in the last step's sampled
        tokens} for those whose last input token is a PLACEHOLDER)."""
        holes: dict[int, int] = {}
        kept = []
        for s in seqs:
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
                src = rows_of.get(s.seq_id)
                if src is None:
                    continue
                holes[len(kept)] = src
            kept.append(s)
        return kept, holes

    def _fill(self, ids: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """ids[dst] = the last step's sampled token src, for each (dst, src): on the device."""
        if pairs:
            (dev,) = stage([np.asarray(pairs, dtype=np.int64).T.copy()], self.device)
            fill_placeholders(ids, dev, self._prev_tokens)

    def push_table_updates(self, updates: list, statics: bool) -> None:
        """Block-table updates (row, index, block) to the device table; ``statics``: the
        staged decode inputs go in the same copy."""
        st = self.statics
        n = len(updates)
        if n > st.max_updates:  # a burst (many long prompts resumed at once): its own copy
            st.push(0, statics)
            upd = torch.tensor(updates, dtype=torch.int64).to(self.device)
            update_block_table(self.table_dev, upd)
            return
        if n:
            st.h_upd[:n] = updates
        st.push(n, statics)
        if n:
            update_block_table(self.table_dev, st.upd[:n])

    # -- decode buckets ---------------------------------------------------------------------
    def _decode_bucket(self, seqs: list[ScheduledSeq], rows: list[int], updates: list,
                       holes: dict[int, int]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        n, B = len(seqs), self.buckets.size_for(len(seqs))
        st, bs = self.statics, self.kv_spec.block_size
        i64 = st.h_i64
        pos = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        row = np.asarray(rows, dtype=np.int64)
        i64[0, :n] = [max(s.token_ids[0], 0) for s in seqs]  # (placeholders: filled below)
        i64[1, :n] = pos
        i64[2, :n] = self.tables.host[row, pos // bs] * bs + pos % bs
        i64[3, :n] = pos + 1
        i64[4, :n] = row
        st.pad_rows(n, B, self.tables.pad_row)
        if self.model.lora is not None:
            st.h_lora[:n] = [s.lora_slot for s in seqs]
        self._stage_sampling(seqs)
        self.push_table_updates(updates, statics=True)
        self._fill(st.ids, list(holes.items()))
        key = (B, self.buckets.split_class(int(pos.max()) + 1))
        logits = self.buckets.replay(key)
        if logits is None:  # first use: recording it runs this very step
            logits = self.record_bucket(*key)
            self.buckets.capture()
        return logits[:n], seqs

    def _stage_sampling(self, seqs: list[ScheduledSeq]) -> None:
        n, st = len(seqs), self.statics
        st.h_i64[5, :n] = [s.seed for s in seqs]
        params = [s.params for s in seqs]
        st.h_topk[:n] = [max(p.top_k, 0) for p in params]
        st.h_f32[0, :n] = [p.temperature for p in params]
        st.h_f32[1, :n] = [p.top_p for p in params]

    def _bucket_batch(self, B: int, max_len: int) -> ForwardBatch:
        st = self.statics
        none = st.lens[:0]
        return ForwardBatch(
            input_ids=st.ids[:B], positions=st.pos[:B], slot_mapping=st.slots[:B], num_decodes=B,
            block_tables=self.table_dev, decode_rows=st.rows[:B], decode_seq_lens=st.lens[:B],
            decode_max_seq_len=max_len,  # sizes the split grid: fixed per recording
            prefill_rows=none, prefill_seq_lens=none, prefill_q_start=st.lens[:1],
            prefill_max_q_len=0, logits_indices=None,
            # with adapters, every bucket runs the LoRA kernels (rows on -1 skip the work)
            lora_slots=None if self.model.lora is None else st.lora_slots[:B])

    def record_bucket(self, B: int, max_len: int) -> torch.Tensor:
        """Record bucket B's forward pass for sequences up to max_len (it runs once, on
        whatever the statics hold); returns its logits buffer."""
        return self.buckets.record((B, max_len), lambda: self.model.forward(
            self._bucket_batch(B, max_len), self.kv_cache))

    # -- eager ------------------------------------------------------------------------------
    def pack(self, seqs: list[ScheduledSeq], rows: list[int], holes: dict[int, int] | None = None
             ) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        """An eager step's batch, its arrays staged in one pinned copy; ``holes``: the
        placeholders to fill on the device (see ``_placeholders``)."""
        arrays, sampled, fills, meta = pack_arrays(seqs, rows, self.tables.host,
                                                   self.kv_spec.block_size, holes or {},
                                                   lora=self.model.lora is not None)
        if meta["max_pos"] >= self.model.rope.max_positions:
            raise ValueError(f"position {meta['max_pos']} is beyond the rotary table "
                             f"({self.model.rope.max_positions})")
        ids, pos, slots, logits_idx, dec_rows, dec_lens, pre_rows, pre_lens, q_start, *lora = \
            stage(arrays, self.device)
        self._fill(ids, fills)
        batch = ForwardBatch(
            input_ids=ids, positions=pos, slot_mapping=slots, num_decodes=meta["num_decodes"],
            block_tables=self.table_dev, decode_rows=dec_rows, decode_seq_lens=dec_lens,
            decode_max_seq_len=meta["decode_max_seq_len"], prefill_rows=pre_rows,
            prefill_seq_lens=pre_lens, prefill_q_start=q_start,
            prefill_max_q_len=meta["prefill_max_q_len"], logits_indices=logits_idx,
            lora_slots=lora[0] if lora else None)
        return batch, sampled

    # -- sampling ---------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], staged: bool) -> Launched:
        """Queue the draw and the copy of its results to the host. ``staged``: the sampling
        parameters already sit in the statics (decode buckets)."""
        if not seqs:
            return Launched(0, 0.0)
        # Host work first: on a GPU the forward pass is still running (the copies below wait
        # for it), so the grammar masks cost no step time unless they take longer than it.
        masks, failed = self.logits.grammar_masks(seqs)
        n, st = len(seqs), self.statics
        params = [s.params for s in seqs]
        if n <= st.cap and not staged:
            self._stage_sampling(seqs)
            st.push(0)
        temperature, top_k, top_p, seeds = self.sampling_tensors(n, seqs)
        num_top = max((p.logprobs or 0) for p in params)
        allowed = None if masks is None else stage([masks], self.device)[0]
        tokens, logprobs, top_ids, top_lps = sample(
            logits, temperature, top_k, top_p, seeds, num_top,
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            processed=self.logits.processed(logits, seqs), allowed=allowed)
        self._prev = ({s.seq_id: i for i, s in enumerate(seqs)}, tokens)
        extra = []
        load = self.model.expert_load
        if load is not None and time.perf_counter() >= self._load_read_at:
            extra, self._load_read_at = [load.counts], time.perf_counter() + EXPERT_LOAD_EVERY_S
        return Launched(0, 0.0, seqs, masks, failed,
                        Readback([tokens, logprobs, top_ids, top_lps, *extra]))

    def sampling_tensors(self, n: int, seqs: list[ScheduledSeq] | None = None
                         ) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, seeds) for n rows: the statics' (staged) when n fits
        them, else tensors of their own (an eager step with more samples than the statics
        hold) from ``seqs`` (None: neutral values, for the warm-up)."""
        st = self.statics
        if n <= st.cap:
            return st.temperature[:n], st.top_k[:n], st.top_p[:n], st.seeds[:n]
        params = [s.params for s in seqs] if seqs is not None else [SamplingParams()] * n
        seeds = [s.seed for s in seqs] if seqs is not None else [0] * n
        dev = self.device
        return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
                torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int32, device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor(seeds, dtype=torch.int64, device=dev))
