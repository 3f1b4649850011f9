"""Shared pieces of the paged attention kernels (prefill and decode).

Tile layout. A program owns ``HEADS_PER_PROG`` KV heads of one sequence. Its query tile has
ROWS rows and COLS = HEADS_PER_PROG * BLOCK_D columns:

    row r = (token, kv head j, query head g within j's group)      r = (tok * HPP + j) * BLOCK_G + g
    col c = (kv head j', dim d)                                      c = j' * BLOCK_D + d

A query row holds its vector only in its own KV head's column block (zeros elsewhere), so one
``tl.dot`` against a key tile [BLOCK_N, COLS] scores every head at once and nothing crosses
heads. On a GPU HEADS_PER_PROG is 1 (no waste, grid over KV heads); the interpreter uses all KV
heads per program because its cost is programs x ops, not FLOPs. GQA comes for free: the G
query heads of a group share the key tile. The decode kernel also stacks several sequences
in one program on the interpreter (row groups = sequence slots, one key tile per slot, a
same-slot mask), for the same reason. BLOCK_D >= 16 because ``tl.dot`` needs K >= 16 on a
GPU (stories260k has head_dim 8); padded columns are masked to zero.

KV is paged: key n of a sequence lives in block ``block_table[n // BLOCK_SIZE]`` at offset
``n % BLOCK_SIZE`` of the cache [num_blocks, BLOCK_SIZE, Hk, Dh].

An int8 cache (QUANT) has a scale per token and KV head beside it ([num_blocks, BLOCK_SIZE,
Hk] fp16, see kv_cache.py). With one KV head per program (the GPU) a key tile's scales are one
per key row, so they fold into the scores and probabilities instead of the tiles:

    q . (c_k * s_k) = (q . c_k) * s_k          p @ (c_v * s_v) = ((p * s_v / m) @ c_v) * m
    (m = the key tile's largest s_v, so p * s_v / m <= 1 stays a normal fp16 number)

and the int8 codes go to tl.dot converted but unscaled (exact in fp16 / bf16: |c| <= 127).
With several heads per program (the interpreter) a row's scale differs by column block, so
the tiles are dequantized instead; both are the same sums up to rounding.

Sliding windows (Mistral, Qwen2, Gemma 2/3's local layers, Phi-3): a query at position p sees
keys n with p - window < n <= p (transformers' sliding-window mask). Keys before the window
are neither loaded nor their block-table entries read (a sequence's blocks wholly out of
every layer's window may already be released), and the loops start at the first key tile that
can hold one: a tile that is wholly masked for a row changes nothing of it (alpha = 1, p = 0),
so where a tile loop starts never changes a row's numbers. Soft-capping (Gemma 2): scores
become cap * tanh(score / cap) before the softmax, computed in the log2 domain as
cap' * tanh(s' / cap') with s' = score * log2(e), cap' = cap * log2(e).
"""

import triton
import triton.language as tl

from tinyserve.kernels.jitmath import softcap as cap_scores
from tinyserve.kernels.kv_cache import check_kv_scales
from tinyserve.kernels.utils import INTERPRET, check, next_pow2


@triton.jit
def tile_layout(pid_h, num_kv_heads, head_dim, stride_kh,
                GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_r = tl.arange(0, ROWS)
    r_tok = offs_r // (HEADS_PER_PROG * BLOCK_G)
    r_j = (offs_r // BLOCK_G) % HEADS_PER_PROG
    r_g = offs_r % BLOCK_G
    r_kvh = pid_h * HEADS_PER_PROG + r_j
    q_head = (r_kvh * GROUP + r_g).to(tl.int64)
    row_ok = (r_g < GROUP) & (r_kvh < num_kv_heads)
    offs_c = tl.arange(0, HEADS_PER_PROG * BLOCK_D)
    c_j = offs_c // BLOCK_D
    c_d = (offs_c % BLOCK_D).to(tl.int64)
    c_kvh = pid_h * HEADS_PER_PROG + c_j
    col_ok = (c_d < head_dim) & (c_kvh < num_kv_heads)
    kv_col_off = c_kvh.to(tl.int64) * stride_kh + c_d
    same_head = r_j[:, None] == c_j[None, :]
    return r_tok.to(tl.int64), q_head, row_ok, c_d, kv_col_off, col_ok, same_head, c_kvh


@triton.jit
def window_start(first_q_pos, window, BLOCK_N: tl.constexpr):
    """The first key a query at first_q_pos (or later) can see, and the key tile it lies in
    (0 for a query before its window's end)."""
    k_lo = tl.maximum(first_q_pos - window + 1, 0)
    return k_lo, (k_lo // BLOCK_N) * BLOCK_N


@triton.jit
def attend_paged(q, q_pos, q_slot, m_i, l_i, acc,
                 k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                 k_slot, k_table_off, k_lo, k_hi, kv_col_off, col_ok, c_kvh, lo, hi,
                 stride_kb, stride_ks, stride_sb, stride_ss, sm_scale_log2, window, cap_log2,
                 BLOCK_N: tl.constexpr, KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 QUANT: tl.constexpr, HEADS_PER_PROG: tl.constexpr, DOT_PREC: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online-softmax attention of q [ROWS, COLS] over key positions [lo, hi), causal on q_pos
    (and within ``window`` of it, with WINDOW; scores soft-capped with SOFTCAP).

    The key tile has KEYS = SEQ_SLOTS * BLOCK_N rows: BLOCK_N positions for each of the
    program's sequence slots. Key row i belongs to slot k_slot[i] (block-table row offset
    k_table_off[i], positions in [k_lo[i], k_hi[i]) loaded); a query row only sees keys of its
    own slot q_slot.
    Scores are in the log2 domain (sm_scale_log2 = scale * log2(e)). Tiles start at ``lo`` in
    fixed BLOCK_N steps and masked keys add exact zeros, so a row's numbers do not depend on
    which other rows or sequences share its program (batch invariance). Rows with no valid key
    yet keep m = -inf, l = 0 (the m_safe guard avoids inf - inf).
    """
    offs_k = tl.arange(0, KEYS).to(tl.int64) % BLOCK_N
    same_seq = k_slot[None, :] == q_slot[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_k
        n_ok = (n < k_hi) & (n >= k_lo)
        block = tl.load(block_tables_ptr + k_table_off + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot_off = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks
        kv_off = slot_off[:, None] + kv_col_off[None, :]
        kv_mask = n_ok[:, None] & col_ok[None, :]
        keep = same_seq & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW:
            keep = keep & (n[None, :] > q_pos[:, None] - window)
        if QUANT:
            s_off = block.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_ss
            if HEADS_PER_PROG == 1:  # one scale per key row: folded into scores and p
                s_off += tl.max(c_kvh, axis=0)
                k_s = tl.load(k_scale_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
                k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0).to(q.dtype)
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * (k_s * sm_scale_log2)[None, :]
            else:
                s_tile = s_off[:, None] + c_kvh[None, :]
                k_s = tl.load(k_scale_ptr + s_tile, mask=kv_mask, other=0.0).to(tl.float32)
                k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0).to(tl.float32) * k_s
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * sm_scale_log2
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        if SOFTCAP:
            qk = cap_scores(qk, cap_log2)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv_scale = 1.0
        if QUANT:
            if HEADS_PER_PROG == 1:
                # p * s_v relative to the tile's largest scale, which multiplies the sum: p * s_v
                # itself would be an fp16 subnormal for small values (max|v| < ~8e-3)
                v_s = tl.load(v_scale_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
                v_top = tl.max(v_s, axis=0)
                pv_scale = tl.where(v_top > 0.0, v_top, 1.0)
                v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0).to(q.dtype)
                pv = (p * (v_s / pv_scale)[None, :]).to(q.dtype)
            else:
                v_s = tl.load(v_scale_ptr + s_tile, mask=kv_mask, other=0.0).to(tl.float32)
                v = (tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0).to(tl.float32) * v_s
                     ).to(q.dtype)
                pv = p.to(q.dtype)
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC) * pv_scale
        m_i = m_new
    return m_i, l_i, acc


LOG2E = 1.4426950408889634


@triton.jit
def add_sink(m_i, l_i, acc, sinks_ptr, q_head, row_ok):
    """gpt-oss's attention sink: one more logit per head (``sinks`` [Hq], natural-log units)
    in every row's softmax, with no value behind it; it only grows the denominator. On the
    unnormalized state (m, l, acc) of attend_paged, before acc / l."""
    s = tl.load(sinks_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys and a -inf sink: no NaN
    alpha = tl.exp2(m_i - m_safe)  # m_i = -inf (no keys): 0
    return m_new, l_i * alpha + tl.exp2(s - m_safe), acc * alpha[:, None]


class HeadParams:
    """Launcher-side view of the head layout shared by both attention kernels."""

    def __init__(self, q, k_cache, v_cache, block_tables, sm_scale: float | None,
                 k_scale=None, v_scale=None, window: int | None = None,
                 softcap: float | None = None, sinks=None):
        check(q.dim() == 3 and q.stride(2) == 1, "q must be [T, Hq, head_dim] with unit last stride")
        check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape
              and k_cache.stride() == v_cache.stride(),
              "k_cache and v_cache must be [num_blocks, block_size, Hk, head_dim], same layout")
        check(k_cache.stride(3) == 1, "caches need unit stride along head_dim")
        self.quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
        check(self.quantized or k_cache.dtype == v_cache.dtype == q.dtype,
              "q and the caches must share a dtype (or the caches be int8 with scales)")
        check(q.dtype.is_floating_point, "q must be a float tensor")
        check(block_tables.dim() == 2, "block_tables must be [B, max_blocks]")
        _, self.block_size, self.num_kv_heads, self.head_dim = k_cache.shape
        self.num_heads = q.shape[1]
        check(q.shape[2] == self.head_dim, "q head_dim differs from the cache's")
        check(self.num_heads % self.num_kv_heads == 0,
              f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        check(self.block_size & (self.block_size - 1) == 0, "block_size must be a power of two")
        self.group = self.num_heads // self.num_kv_heads
        self.block_g = next_pow2(self.group)
        self.block_d = max(16, next_pow2(self.head_dim))
        self.heads_per_prog = next_pow2(self.num_kv_heads) if INTERPRET else 1
        # head_dim 256 (Gemma): the [rows, 256] fp32 accumulator and q tile spill at 4 warps
        # (ptxas, sm_90); 8 warps halve what each thread holds
        self.num_warps = 8 if self.block_d >= 256 else 4
        scale = sm_scale if sm_scale is not None else self.head_dim ** -0.5
        self.sm_scale_log2 = scale * LOG2E
        check(window is None or window >= 1, f"window must be >= 1, got {window}")
        check(softcap is None or softcap > 0, f"softcap must be > 0, got {softcap}")
        self.window = window or 0
        self.cap_log2 = (softcap or 0.0) * LOG2E
        if sinks is not None:
            check(sinks.shape == (self.num_heads,) and sinks.dtype.is_floating_point
                  and sinks.is_contiguous() and sinks.device == q.device,
                  f"sinks must be a contiguous float [{self.num_heads}] (one per query head)")
        self.sinks = sinks if sinks is not None else q  # (q: a pointer never read)
        self.flags = {"WINDOW": window is not None, "SOFTCAP": softcap is not None,
                      "SINKS": sinks is not None}
        self.kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        self.kv_grid = -(-self.num_kv_heads // self.heads_per_prog)
        # (an unquantized cache passes its own tensors where the scales would go: never read)
        self.scales = (k_scale, v_scale) if self.quantized else (k_cache, v_cache)
        self.scale_strides = (k_scale.stride(0), k_scale.stride(1)) if self.quantized else (0, 0)
