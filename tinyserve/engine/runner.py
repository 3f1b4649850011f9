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

Both read the persistent block table (block_tables.py); plans carry only new blocks. Results
come back as plain Python (one device-to-host copy per step, for the sampled tokens).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tinyserve.engine.block_tables import BlockTables
from tinyserve.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tinyserve.engine.logits_processing import LogitsProcessors
from tinyserve.engine.model import DecoderModel, ForwardBatch
from tinyserve.engine.model_config import ModelConfig
from tinyserve.kernels import sample, update_block_table
from tinyserve.kernels.utils import Recording, next_pow2, recording
from tinyserve.messages import SamplingParams, ScheduledSeq, SeqOutput, StepPlan, StepResult

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then 2^k and 1.5 * 2^k (at most a third of a bucket is padding), capped."""
    sizes = {1, 2, 4, 8}
    p = 16
    while p < max_num_seqs:
        sizes |= {p, p * 3 // 2}
        p *= 2
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


class _Statics:
    """Static decode inputs: one host staging buffer and its device twin, as typed views.

    Layout (bytes): int64 [6, cap] (ids, positions, slots, seq lens, table rows, seeds) |
    int32 [cap] (top_k) | fp32 [2, cap] (temperature, top_p) | int64 [max_updates, 3]
    (block-table updates). A step copies the prefix up to its last update: one copy.
    """

    def __init__(self, capacity: int, max_updates: int, device: torch.device) -> None:
        cap = -(-capacity // 8) * 8  # keeps every section 8-byte aligned
        self.cap, self.max_updates = cap, max_updates
        self.upd_offset = 60 * cap
        nbytes = self.upd_offset + 24 * max_updates
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        h = self.host.numpy()
        self.h_i64 = h[: 48 * cap].view(np.int64).reshape(6, cap)
        self.h_topk = h[48 * cap: 52 * cap].view(np.int32)
        self.h_f32 = h[52 * cap: 60 * cap].view(np.float32).reshape(2, cap)
        self.h_upd = h[self.upd_offset:].view(np.int64).reshape(max_updates, 3)
        d = self.dev
        i64 = d[: 48 * cap].view(torch.int64).view(6, cap)
        self.ids, self.pos, self.slots, self.lens, self.rows, self.seeds = i64.unbind(0)
        self.top_k = d[48 * cap: 52 * cap].view(torch.int32)
        self.temperature, self.top_p = d[52 * cap: 60 * cap].view(torch.float32).view(2, cap).unbind(0)
        self.upd = d[self.upd_offset:].view(torch.int64).view(max_updates, 3)

        # On a GPU the copy is asynchronous: the host buffer is not written again until the
        # last copy out of it has run (steps usually sync on their sampled tokens anyway).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def pad_rows(self, start: int, end: int, pad_row: int) -> None:
        """Rows [start, end) as padding: token 0 at position 0, no KV write (slot -1), one key
        in the block table's all-zero padding row. They compute garbage nobody reads."""
        self.h_i64[0:2, start:end] = 0
        self.h_i64[2, start:end] = -1
        self.h_i64[3, start:end] = 1
        self.h_i64[4, start:end] = pad_row

    def writable(self) -> None:
        """Wait until the host buffer may be written (call before staging a step)."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def push(self, num_updates: int, statics: bool = True) -> None:
        start = 0 if statics else self.upd_offset
        end = self.upd_offset + 24 * num_updates
        if end > start:
            self.dev[start:end].copy_(self.host[start:end], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
                self._pending = True


class ModelRunner:
    def __init__(self, model: DecoderModel, cfg: ModelConfig, kv_spec: KVCacheSpec,
                 device: torch.device | str, *, max_num_seqs: int = 64,
                 max_model_len: int | None = None, enforce_eager: bool = False) -> None:
        self.model = model
        self.cfg = cfg
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
        self.buckets = () if enforce_eager else decode_buckets(max_num_seqs)
        self.statics = _Statics(max(self.buckets, default=1), max(256, 2 * width), self.device)
        self._pools: dict = {}  # scratch buffers shared by every bucket's recording
        # (bucket, split class) -> (recording, its logits buffer, its CUDA graph or None)
        self._recorded: dict[tuple[int, int], tuple[Recording, torch.Tensor, object]] = {}
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        # penalties, grammar masks, prompt logprobs (its ``grammars`` set by the DeviceEngine)
        self.logits = LogitsProcessors(cfg.vocab_size, cfg.eos_token_ids, self.device)

    # -- one step ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        seqs = sorted(plan.seqs, key=lambda s: len(s.token_ids) != 1)  # decodes first (stable)
        # Freed rows go back first; every check that can refuse the step runs before the
        # table changes (the host mirror and the device table must not part ways over it).
        self.tables.release(plan.freed)
        self.logits.forget(plan.freed)
        max_pos = self.model.rope.max_positions
        if seqs and max(s.start_pos + len(s.token_ids) for s in seqs) > max_pos:
            raise ValueError(f"a position is beyond the rotary table ({max_pos})")
        self.statics.writable()
        rows, updates = self.tables.apply((), seqs)
        # Buckets take decodes that all sample (a one-token prompt chunk cut short by the
        # token budget does not: that step runs eager).
        bucketed = bool(seqs) and len(seqs[-1].token_ids) == 1 \
            and len(seqs) <= (self.buckets or (0,))[-1] and all(s.sample for s in seqs)
        if bucketed:
            logits, sampled = self._decode_bucket(seqs, rows, updates)
        else:
            self.push_table_updates(updates, statics=False)
            if not seqs:
                return StepResult(step_id=plan.step_id, outputs=())
            batch, sampled = self.pack(seqs, rows)
            logits = self.model.forward(batch, self.kv_cache)
        prompt_lps = ()
        if not bucketed and any(s.prompt_targets for s in seqs):
            prompt_lps = self.logits.prompt_logprobs(logits[len(sampled):], seqs)
            logits = logits[:len(sampled)]
        outputs = self._sample(logits, sampled, staged=bucketed)
        return StepResult(step_id=plan.step_id, outputs=outputs,
                          seconds=time.perf_counter() - t0, prompt_logprobs=prompt_lps)

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
    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decodes exceed the largest bucket")

    def _decode_bucket(self, seqs: list[ScheduledSeq], rows: list[int],
                       updates: list) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        n, B = len(seqs), self._bucket(len(seqs))
        st, bs = self.statics, self.kv_spec.block_size
        i64 = st.h_i64
        pos = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        row = np.asarray(rows, dtype=np.int64)
        i64[0, :n] = [s.token_ids[0] for s in seqs]
        i64[1, :n] = pos
        i64[2, :n] = self.tables.host[row, pos // bs] * bs + pos % bs
        i64[3, :n] = pos + 1
        i64[4, :n] = row
        st.pad_rows(n, B, self.tables.pad_row)
        self._stage_sampling(seqs)
        self.push_table_updates(updates, statics=True)
        key = (B, self._split_class(int(pos.max()) + 1))
        recorded = self._recorded.get(key)
        if recorded is None:  # first use: recording it ran this very step
            logits = self.record_bucket(*key)
        else:
            rec, logits, graph = recorded
            if graph is not None:
                graph.replay()
            else:
                rec.replay()
        return logits[:n], seqs

    def _split_class(self, longest: int) -> int:
        """The decode length a recording is sized for: the batch's longest sequence rounded up
        to a power-of-two number of KV splits (capped at max_model_len). A fixed grid must
        cover the longest; one per power of two keeps short batches off a 128k-sized grid of
        idle programs, at log2(max_model_len / split) recordings per bucket."""
        from tinyserve.kernels.attention_decode import default_split_size

        split = default_split_size()
        return min(next_pow2(-(-longest // split)) * split, self.max_model_len)

    def split_classes(self) -> list[int]:
        from tinyserve.kernels.attention_decode import default_split_size

        classes, n, split = [], 1, default_split_size()
        while True:
            classes.append(min(n * split, self.max_model_len))
            if n * split >= self.max_model_len:
                return classes
            n *= 2

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
            prefill_max_q_len=0, logits_indices=None)

    @property
    def recorded(self) -> frozenset[tuple[int, int]]:
        """The (bucket, split class) pairs recorded so far."""
        return frozenset(self._recorded)

    def record_bucket(self, B: int, max_len: int) -> torch.Tensor:
        """Record bucket B's forward pass for sequences up to max_len (it runs once, on
        whatever the statics hold), and capture it as a CUDA graph on a GPU; returns its
        logits buffer."""
        if (B, max_len) in self._recorded:
            return self._recorded[B, max_len][1]
        rec = Recording(self.buckets[-1], self._pools)
        with recording(rec):
            logits = self.model.forward(self._bucket_batch(B, max_len), self.kv_cache)
        graph = None
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                rec.replay()
        self._recorded[B, max_len] = (rec, logits, graph)
        return logits

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in self._pools.values() for t in pool)

    # -- eager ------------------------------------------------------------------------------
    def pack(self, seqs: list[ScheduledSeq], rows: list[int]
             ) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        bs = self.kv_spec.block_size
        table = self.tables.host
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        dec_rows, dec_lens, pre_rows, pre_lens, q_start = [], [], [], [], [0]
        for s, row in zip(seqs, rows, strict=True):
            n = len(s.token_ids)
            end = s.start_pos + n
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            blocks = table[row]
            slots.extend(int(blocks[p // bs]) * bs + p % bs for p in range(s.start_pos, end))
            if n == 1:
                dec_rows.append(row)
                dec_lens.append(end)
            else:
                pre_rows.append(row)
                pre_lens.append(end)
                q_start.append(q_start[-1] + n)
            if s.sample:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(s)
            if s.prompt_targets:  # rows after the sampled ones (forward keeps this order)
                first = len(input_ids) - n
                prompt_rows.extend(range(first, first + len(s.prompt_targets)))
        max_pos = self.model.rope.max_positions
        if positions and max(positions) >= max_pos:
            raise ValueError(f"position {max(positions)} is beyond the rotary table ({max_pos})")

        dev = self.device

        def ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = ForwardBatch(
            input_ids=ints(input_ids), positions=ints(positions), slot_mapping=ints(slots),
            num_decodes=len(dec_lens), block_tables=self.table_dev,
            decode_rows=ints(dec_rows, torch.int32), decode_seq_lens=ints(dec_lens, torch.int32),
            decode_max_seq_len=max(dec_lens, default=0),
            prefill_rows=ints(pre_rows, torch.int32), prefill_seq_lens=ints(pre_lens, torch.int32),
            prefill_q_start=ints(q_start, torch.int32),
            prefill_max_q_len=max((b - a for a, b in zip(q_start, q_start[1:])), default=0),
            logits_indices=ints(logits_rows + prompt_rows))
        return batch, sampled

    # -- sampling ---------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq],
                staged: bool) -> tuple[SeqOutput, ...]:
        """``staged``: the sampling parameters already sit in the statics (decode buckets)."""
        if not seqs:
            return ()
        # Host work first: on a GPU the forward pass is still running (the copies below wait
        # for it), so the grammar masks cost no step time unless they take longer than it.
        masks = self.logits.grammar_masks(seqs)
        n, st = len(seqs), self.statics
        params = [s.params for s in seqs]
        if n <= st.cap and not staged:
            self._stage_sampling(seqs)
            st.push(0)
        temperature, top_k, top_p, seeds = self.sampling_tensors(n, seqs)
        num_top = max((p.logprobs or 0) for p in params)
        tokens, logprobs, top_ids, top_lps = sample(
            logits, temperature, top_k, top_p, seeds, num_top,
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            processed=self.logits.processed(logits, seqs),
            allowed=None if masks is None else torch.from_numpy(masks).to(self.device))
        tokens_l, lps_l = tokens.tolist(), logprobs.tolist()
        # A row whose constraints leave nothing drew a banned token: it ends instead, with
        # EOS where the request allows it, else with an error (never the banned token).
        ends = self.logits.dead_ends(seqs, masks)
        for i, end in ends.items():
            tokens_l[i] = end if isinstance(end, int) else -1
        if masks is not None:
            self.logits.advance(seqs, tokens_l)
        tops = None if top_ids is None else list(zip(top_ids.tolist(), top_lps.tolist(),
                                                     strict=True))
        out = []
        for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
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
