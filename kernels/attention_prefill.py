"""Paged attention for prefill ("context" attention, ragged batch, causal).

Sequence b computes ``q_len_b = q_start[b+1] - q_start[b]`` new query tokens, the last q_len_b
of its ``seq_len_b`` tokens; their K/V are already written to the cache, together with any
cached prefix, so every key is read from the paged cache:

    key positions   0 ............ ctx_len_b ............ seq_len_b
                    |-- cached prefix / earlier chunks --|-- this step's queries --|

    out[t, h] = softmax_{n <= pos(t)}(q[t, h] . k[n, h // G] * scale) @ v[n, h // G]

That one rule covers plain prefill, prefix-cache hits and chunked prefill; a sliding window
adds n > pos(t) - window, and soft-capping caps the scores (attention_common.py). Layouts: q, out
[T, Hq, Dh]; caches [num_blocks, block_size, Hk, Dh]; block_tables [B, max_blocks] int32 (or
[R, max_blocks] with ``table_rows`` [B] naming each sequence's row); seq_lens [B]; q_start
[B + 1] (exclusive prefix sums of q_len). An int8 cache comes with k_scale / v_scale
[num_blocks, block_size, Hk] fp16 (kv_cache.py), dequantized inside (attention_common.py).
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
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch


@triton.jit
def _context_attention_paged_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, block_tables_ptr,
    table_rows_ptr, b_seq_len_ptr,
    b_q_start_ptr, sinks_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_btb,
    sm_scale_log2, num_kv_heads, head_dim, window, cap_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, HAS_ROWS: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_m = tl.program_id(2)
    q_start = tl.load(b_q_start_ptr + b).to(tl.int64)
    q_len = tl.load(b_q_start_ptr + b + 1).to(tl.int64) - q_start
    if pid_m * BLOCK_M < q_len:
        ROWS: tl.constexpr = BLOCK_M * HEADS_PER_PROG * BLOCK_G
        COLS: tl.constexpr = HEADS_PER_PROG * BLOCK_D
        r_tok, q_head, row_ok, c_d, kv_col_off, col_ok, same_head, c_kvh = tile_layout(
            pid_h, num_kv_heads, head_dim, stride_kh,
            GROUP, BLOCK_G, HEADS_PER_PROG, ROWS, BLOCK_D)
        seq_len = tl.load(b_seq_len_ptr + b).to(tl.int64)
        ctx_len = seq_len - q_len
        m_idx = pid_m * BLOCK_M + r_tok
        row_ok = row_ok & (m_idx < q_len)
        q_pos = ctx_len + m_idx
        tile_mask = row_ok[:, None] & col_ok[None, :] & same_head
        q_off = (q_start + m_idx)[:, None] * stride_qt + q_head[:, None] * stride_qh + c_d[None, :]
        q = tl.load(q_ptr + q_off, mask=tile_mask, other=0.0)

        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.full([ROWS], 0.0, dtype=tl.float32)
        acc = tl.full([ROWS, COLS], 0.0, dtype=tl.float32)
        hi = tl.minimum(seq_len, ctx_len + (pid_m + 1) * BLOCK_M)
        zero_k = tl.full([BLOCK_N], 0, dtype=tl.int64)
        k_lo, lo = 0, 0
        if WINDOW:  # (the tile's first query sees the earliest keys)
            k_lo, lo = window_start(ctx_len + pid_m * BLOCK_M, window, BLOCK_N)
        if HAS_ROWS:  # sequence b's blocks are row table_rows[b] of a persistent table
            table_row = tl.load(table_rows_ptr + b).to(tl.int64)
        else:
            table_row = b.to(tl.int64)
        m_i, l_i, acc = attend_paged(
            q, q_pos, r_tok * 0, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr,
            zero_k, zero_k + table_row * stride_btb, zero_k + k_lo, zero_k + seq_len, kv_col_off,
            col_ok, c_kvh, lo, hi, stride_kb, stride_ks, stride_sb, stride_ss, sm_scale_log2,
            window, cap_log2, BLOCK_N, BLOCK_N, BLOCK_SIZE, QUANT, HEADS_PER_PROG, DOT_PREC,
            WINDOW, SOFTCAP)
        if SINKS:
            m_i, l_i, acc = add_sink(m_i, l_i, acc, sinks_ptr, q_head, row_ok)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + m_idx)[:, None] * stride_ot + q_head[:, None] * stride_oh + c_d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


def context_attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            q_start: torch.Tensor, max_q_len: int,
                            sm_scale: float | None = None, out: torch.Tensor | None = None,
                            block_n: int | None = None,
                            table_rows: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, Dh] -> out: [T, Hq, Dh]. ``max_q_len`` (host int) sizes the grid; ``window``:
    a sliding window (keys within ``window`` of the query); ``softcap``: score soft-capping;
    ``sinks`` [Hq]: a logit per head in every softmax with no value (gpt-oss).

    Tile sizes depend only on the model, never on the batch, so a row's numbers do not change
    with what else is batched with it (greedy outputs are batch invariant).
    """
    hp = HeadParams(q, k_cache, v_cache, block_tables, sm_scale, k_scale, v_scale, window, softcap,
                    sinks)
    B = seq_lens.shape[0]
    check(q_start.shape == (B + 1,), "q_start must be [B + 1]")
    check(block_tables.shape[0] == B if table_rows is None else table_rows.shape == (B,),
          "block_tables must be [B, max_blocks], or table_rows [B]")
    if out is None:
        out = empty(q.shape, q.dtype, q.device)
    check(out.shape == q.shape and out.stride(2) == 1, "out must match q")
    if B == 0 or q.shape[0] == 0:
        return out
    if INTERPRET:
        block_m, default_n = 64, 128
    elif q.dtype == torch.float32:  # no fp32 tensor-core path: smaller tiles avoid spills
        rows = 16 if hp.quantized else 32
        block_m, default_n = max(1, rows // hp.block_g), rows
    else:  # (int8 codes converted in registers: half-width key tiles keep it spill-free;
        # head_dim 256: half the query rows too)
        rows = 64 if hp.block_d <= 128 else 32
        block_m, default_n = max(1, rows // hp.block_g), 32 if hp.quantized else 64
    block_n = block_n or default_n
    check(block_n >= 16 and block_n & (block_n - 1) == 0, "block_n must be a power of two >= 16")
    grid = (B, hp.kv_grid, cdiv(max_q_len, block_m))
    launch(_context_attention_paged_kernel, grid,
        q, k_cache, v_cache, *hp.scales, out, block_tables,
        table_rows if table_rows is not None else seq_lens, seq_lens, q_start, hp.sinks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *hp.kv_strides,
        *hp.scale_strides, block_tables.stride(0), hp.sm_scale_log2, hp.num_kv_heads, hp.head_dim,
        hp.window, hp.cap_log2,
        GROUP=hp.group, BLOCK_G=hp.block_g, HEADS_PER_PROG=hp.heads_per_prog,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=hp.block_d, BLOCK_SIZE=hp.block_size, QUANT=hp.quantized,
        HAS_ROWS=table_rows is not None, DOT_PREC=dot_precision(q.dtype), **hp.flags,
        num_warps=hp.num_warps)
    return out
