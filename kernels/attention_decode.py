"""Paged attention for decode ("token" attention): one query token per sequence, split-KV.

Stage 1 splits each sequence's keys into chunks of ``split_size`` and attends to each chunk in
its own program (so a long context still fills the GPU at small batch):

    o_s   = softmax(q . K_s) @ V_s          lse_s = log2 sum exp2(scores_s)

Stage 2 merges the splits:  out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),  m = max lse
(16 splits at a time with a running max, so a 128k context merges in registers).
With a single split stage 1 writes ``out`` directly. ``split_size`` is fixed per process, so the
split of a sequence depends on its own length only (batch invariant). With a sliding window,
splits wholly before a sequence's window are skipped in both stages (its first split is
(len - window) // split_size, again a function of its own length). Sinks (gpt-oss: a logit per
head with no value) join the softmax once: in stage 1 with a single split, else in the merge.
Layouts: q, out [B, Hq, Dh]; caches [num_blocks, block_size, Hk, Dh]; block_tables
[B, max_blocks] int32, or [R, max_blocks] with ``table_rows`` [B] naming each sequence's row
(a persistent table); seq_lens [B] (including the query token, already in the cache). An int8 cache comes with
k_scale / v_scale [num_blocks, block_size, Hk] fp16 (kv_cache.py), dequantized inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.attention_common import (
    HeadParams,
    add_sink,
    attend_paged,
    tile_layout,
    window_start,
)
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2


@triton.jit
def _token_attention_paged_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, table_rows_ptr, b_seq_len_ptr, sinks_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    sm_scale_log2, num_seqs, num_kv_heads, head_dim, split_size, window, cap_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    SEQ_SLOTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, SINGLE_SPLIT: tl.constexpr, HAS_ROWS: tl.constexpr,
    DOT_PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    seq0 = tl.program_id(0).to(tl.int64) * SEQ_SLOTS
    pid_h = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    COLS: tl.constexpr = HEADS_PER_PROG * BLOCK_D
    KEYS: tl.constexpr = SEQ_SLOTS * BLOCK_N
    # Row groups are sequence slots here (one query token each).
    r_slot, q_head, row_ok, c_d, kv_col_off, col_ok, same_head, c_kvh = tile_layout(
        pid_h, num_kv_heads, head_dim, stride_kh, GROUP, BLOCK_G, HEADS_PER_PROG, ROWS, BLOCK_D)
    row_b = seq0 + r_slot
    row_ok = row_ok & (r_slot < SEQ_SLOTS) & (row_b < num_seqs)
    row_len = tl.load(b_seq_len_ptr + row_b, mask=row_ok, other=0).to(tl.int64)
    lo = split * split_size
    row_ok = row_ok & (lo < row_len)  # this split exists for the row's sequence
    if WINDOW:  # ... and reaches into its window
        row_ok = row_ok & (lo + split_size > row_len - window)
        _, first = window_start(tl.min(tl.where(row_ok, row_len - 1, 2**62), axis=0), window,
                                BLOCK_N)
        loop_lo = tl.maximum(lo, first)
    else:
        loop_lo = lo
    hi = tl.minimum(tl.max(tl.where(row_ok, row_len, 0), axis=0), lo + split_size)
    if loop_lo < hi:
        tile_mask = row_ok[:, None] & col_ok[None, :] & same_head
        q = tl.load(q_ptr + row_b[:, None] * stride_qb + q_head[:, None] * stride_qh + c_d[None, :],
                    mask=tile_mask, other=0.0)
        k_slot = tl.arange(0, KEYS).to(tl.int64) // BLOCK_N
        k_b = seq0 + k_slot
        k_len = tl.load(b_seq_len_ptr + k_b, mask=k_b < num_seqs, other=0).to(tl.int64)
        if HAS_ROWS:  # sequence b's blocks are row table_rows[b] of a persistent table
            k_row = tl.load(table_rows_ptr + k_b, mask=k_b < num_seqs, other=0).to(tl.int64)
        else:
            k_row = k_b
        k_lo = tl.maximum(k_len - window, 0) if WINDOW else k_len * 0
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.full([ROWS], 0.0, dtype=tl.float32)
        acc = tl.full([ROWS, COLS], 0.0, dtype=tl.float32)
        m_i, l_i, acc = attend_paged(
            q, row_len - 1, r_slot, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr,
            k_slot, k_row * stride_btb, k_lo, tl.minimum(k_len, lo + split_size), kv_col_off,
            col_ok, c_kvh, loop_lo, hi, stride_kb, stride_ks, stride_sb, stride_ss, sm_scale_log2,
            window, cap_log2, BLOCK_N, KEYS, BLOCK_SIZE, QUANT, HEADS_PER_PROG, DOT_PREC, WINDOW,
            SOFTCAP)
        if SINKS and SINGLE_SPLIT:  # (with splits, the merge adds it once)
            m_i, l_i, acc = add_sink(m_i, l_i, acc, sinks_ptr, q_head, row_ok)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows without keys in this split: not stored
        acc = acc / l_safe[:, None]
        if SINGLE_SPLIT:
            tl.store(out_ptr + row_b[:, None] * stride_ob + q_head[:, None] * stride_oh
                     + c_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
        else:
            tl.store(part_out_ptr + row_b[:, None] * stride_pb + q_head[:, None] * stride_ph
                     + split * stride_ps + c_d[None, :], acc, mask=tile_mask)
            tl.store(part_lse_ptr + row_b * stride_lb + q_head * stride_lh + split,
                     m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, b_seq_len_ptr, sinks_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_heads, head_dim, split_size, window,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    # Splits are merged BLOCK_S at a time with a running max (as online softmax does), so a
    # 128k context (256 splits) keeps a [BLOCK_H, BLOCK_S, BLOCK_D] tile in registers instead
    # of one tile of all splits. BLOCK_S is fixed: a row's merge order follows its own length.
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    seq_len = tl.load(b_seq_len_ptr + b)
    num_splits = tl.cdiv(seq_len, split_size)
    first = tl.maximum(seq_len - window, 0) // split_size if WINDOW else 0  # (earlier: skipped)
    h_ok = offs_h < num_heads
    d_ok = offs_d < head_dim
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s0 in range(first, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
        s_ok = offs_s < num_splits
        lse = tl.load(part_lse_ptr + b * stride_lb + offs_h[:, None] * stride_lh + offs_s[None, :],
                      mask=h_ok[:, None] & s_ok[None, :], other=float("-inf"))
        lse = tl.where(h_ok[:, None], lse, 0.0)  # keep padded heads finite
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        # first chunk: exp2(-inf) = 0, acc and l_sum start clean; a chunk of empty splits
        # only (never from finite scores) keeps m = -inf: no inf - inf
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp2(m - m_new))
        w = tl.exp2(lse - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
        mask3 = h_ok[:, None, None] & s_ok[None, :, None] & d_ok[None, None, :]
        o = tl.load(part_out_ptr + b * stride_pb + offs_h[:, None, None] * stride_ph
                    + offs_s[None, :, None] * stride_ps + offs_d[None, None, :],
                    mask=mask3, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=1)
        l_sum = l_sum * alpha + tl.sum(w, axis=1)
        m = m_new
    if SINKS:  # one more term: 2^(sink - m) in the denominator, nothing in the sum
        m, l_sum, acc = add_sink(m, l_sum, acc, sinks_ptr, offs_h, h_ok)
    merged = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


MERGE_SPLITS = 16  # splits merged per iteration


def default_split_size() -> int:
    # Interpreter: splitting only adds programs. GPU: 512-token splits keep B * Hk * splits
    # programs in flight for long contexts without a reduce that dominates short ones.
    return 4096 if INTERPRET else 512


def token_attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                          sm_scale: float | None = None, out: torch.Tensor | None = None,
                          split_size: int | None = None, block_n: int | None = None,
                          table_rows: torch.Tensor | None = None,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, window: int | None = None,
                          softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, Dh] -> out: [B, Hq, Dh]. ``max_seq_len`` (host int) sizes the split grid;
    ``window``, ``softcap`` and ``sinks`` as in context_attention_paged."""
    hp = HeadParams(q, k_cache, v_cache, block_tables, sm_scale, k_scale, v_scale, window, softcap,
                    sinks)
    B = q.shape[0]
    check(seq_lens.shape == (B,), "seq_lens must be [B]")
    check(block_tables.shape[0] == B if table_rows is None else table_rows.shape == (B,),
          "block_tables must be [B, max_blocks], or table_rows [B]")
    if out is None:
        out = empty(q.shape, q.dtype, q.device)
    check(out.shape == q.shape and out.stride(2) == 1, "out must match q")
    if B == 0:
        return out
    block_n = block_n or (128 if INTERPRET else 32 if q.dtype == torch.float32 else 64)
    split_size = split_size or default_split_size()
    check(split_size % block_n == 0, "split_size must be a multiple of block_n")
    num_splits = cdiv(max_seq_len, split_size)
    single = num_splits == 1
    if single:  # stage 1 writes `out`; the partial buffers are never touched
        part_out = part_lse = out
        p_strides, l_strides = (0, 0, 0), (0, 0)
    else:
        part_out = empty((B, hp.num_heads, num_splits, hp.head_dim), torch.float32, q.device)
        part_lse = empty((B, hp.num_heads, num_splits), torch.float32, q.device)
        p_strides, l_strides = part_out.stride()[:3], part_lse.stride()[:2]
    # Interpreter: up to 16 sequences per program (cost ~ programs, not FLOPs). GPU: one.
    slots = min(16, next_pow2(B)) if INTERPRET else 1
    rows = max(16, slots * hp.heads_per_prog * hp.block_g)
    launch(_token_attention_paged_kernel, (cdiv(B, slots), hp.kv_grid, num_splits),
        q, k_cache, v_cache, *hp.scales, out, part_out, part_lse, block_tables,
        table_rows if table_rows is not None else seq_lens, seq_lens, hp.sinks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *hp.kv_strides,
        *hp.scale_strides, block_tables.stride(0), *p_strides, *l_strides,
        hp.sm_scale_log2, B, hp.num_kv_heads, hp.head_dim, split_size, hp.window, hp.cap_log2,
        GROUP=hp.group, BLOCK_G=hp.block_g, HEADS_PER_PROG=hp.heads_per_prog,
        SEQ_SLOTS=slots, ROWS=rows,
        BLOCK_N=block_n, BLOCK_D=hp.block_d, BLOCK_SIZE=hp.block_size, QUANT=hp.quantized,
        SINGLE_SPLIT=single,
        HAS_ROWS=table_rows is not None,
        DOT_PREC=dot_precision(q.dtype), **hp.flags, num_warps=hp.num_warps)
    if not single:
        block_h = next_pow2(hp.num_heads) if INTERPRET else 1
        launch(_merge_splits_kernel, (B, cdiv(hp.num_heads, block_h)),
            part_out, part_lse, out, seq_lens, hp.sinks, *p_strides, *l_strides,
            out.stride(0), out.stride(1), hp.num_heads, hp.head_dim, split_size, hp.window,
            BLOCK_H=block_h, BLOCK_S=MERGE_SPLITS, BLOCK_D=next_pow2(hp.head_dim),
            WINDOW=hp.flags["WINDOW"], SINKS=hp.flags["SINKS"])
    return out
