"""Rotary position embedding, "rotate-half" convention, applied in place to q and k; optionally
after a per-head RMSNorm of q and k (Qwen3, Gemma 3), and fused with the KV-cache write.

For each token t at position p = positions[t], each head, and i < HALF = rotary_dim / 2:

    x1, x2 = x[i], x[i + HALF]
    x[i]        = x1 * cos[p, i] - x2 * sin[p, i]
    x[i + HALF] = x2 * cos[p, i] + x1 * sin[p, i]

and x[rotary_dim:] passes through (partial rotary, Phi-3: rotary_dim = head_dim * factor).
``cos``/``sin`` [max_pos, HALF] fp32 are precomputed at load time (scaling, YaRN's attention
factor, LongRoPE's short/long split all live in the table), so rope variants cost the kernel
nothing; rotary_dim is read off the table's width.

q/k norm (``qk_norm = (q_weight, k_weight, eps, unit_offset)``, weights [head_dim]): before the
rotation, each q head and each k head is RMS-normalized over head_dim and times its weight,
as transformers does it: Qwen3RMSNorm (rounded to the model dtype, then times w) or, with
``unit_offset``, Gemma3RMSNorm (times 1 + w in fp32). v is never normalized.

Layouts: q [T, Hq, head_dim], k [T, Hk, head_dim] (unit stride along head_dim; usually strided
views of one fused qkv projection); positions [T] int. A head is loaded as three parts
[0, HALF), [HALF, 2 HALF), [2 HALF, head_dim): the pair (i, i + HALF) sits in one thread's
registers, so rotating in place is race-free, and the norm's sum of squares is a register sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyserve.kernels.kv_cache import (
    check_kv_scales,
    finite_or_zero,
    quantize_kv,
    write_kv_cache,
)
from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch, next_pow2


class QKNorm(NamedTuple):
    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    unit_offset: bool = False  # Gemma: times (1 + w), in fp32


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, ok, stride_cp, offs_d, HALF):
    """cos, sin [BLOCK_T, 1, BLOCK_HALF] for each token's position; a masked-out token (or a
    position outside the table) rotates by nothing: cos 1, sin 0."""
    cs_mask = ok[:, None] & (offs_d < HALF)[None, :]
    cs_off = pos[:, None] * stride_cp + offs_d[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0)[:, None, :]
    sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)[:, None, :]
    return cos, sin


@triton.jit
def _load_parts(ptrs, mask, offs_d, offs_r, HALF, REST, HAS_REST: tl.constexpr):
    """A head's three parts, fp32 (padding lanes 0): ptrs [BT, BH, 1] point at dim 0."""
    m12 = mask[:, :, None] & (offs_d < HALF)[None, None, :]
    x1 = tl.load(ptrs + offs_d[None, None, :], mask=m12, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF + offs_d[None, None, :], mask=m12, other=0.0).to(tl.float32)
    if HAS_REST:
        m3 = mask[:, :, None] & (offs_r < REST)[None, None, :]
        x3 = tl.load(ptrs + 2 * HALF + offs_r[None, None, :], mask=m3, other=0.0).to(tl.float32)
    else:
        x3 = x1
    return x1, x2, x3


@triton.jit
def _store_parts(ptrs, y1, y2, y3, mask, offs_d, offs_r, HALF, REST, HAS_REST: tl.constexpr):
    m12 = mask[:, :, None] & (offs_d < HALF)[None, None, :]
    tl.store(ptrs + offs_d[None, None, :], y1.to(ptrs.dtype.element_ty), mask=m12)
    tl.store(ptrs + HALF + offs_d[None, None, :], y2.to(ptrs.dtype.element_ty), mask=m12)
    if HAS_REST:
        m3 = mask[:, :, None] & (offs_r < REST)[None, None, :]
        tl.store(ptrs + 2 * HALF + offs_r[None, None, :], y3.to(ptrs.dtype.element_ty), mask=m3)


@triton.jit
def _norm_parts(x1, x2, x3, is_q, qw_ptr, kw_ptr, offs_d, offs_r, HALF, REST, head_dim, eps,
                HAS_REST: tl.constexpr, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm over the head's parts, times q's weight on q heads (is_q [1, BH, 1]), k's on
    the others."""
    ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
    if HAS_REST:
        ss += tl.sum(x3 * x3, axis=2)
    rstd = tl.rsqrt(ss / head_dim + eps)[:, :, None]
    d_ok = offs_d < HALF
    w1 = tl.where(is_q, tl.load(qw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :],
                  tl.load(kw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :])
    w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :],
                  tl.load(kw_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :])
    y1, y2 = x1 * rstd, x2 * rstd
    if not UNIT_OFFSET:  # (Qwen3: the normalized value in the model dtype, then times w)
        y1, y2 = y1.to(DTYPE).to(tl.float32), y2.to(DTYPE).to(tl.float32)
    else:
        w1, w2 = 1.0 + w1, 1.0 + w2
    y3 = x3
    if HAS_REST:
        r_ok = offs_r < REST
        w3 = tl.where(is_q,
                      tl.load(qw_ptr + 2 * HALF + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, None, :],
                      tl.load(kw_ptr + 2 * HALF + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, None, :])
        y3 = x3 * rstd
        if UNIT_OFFSET:
            w3 = 1.0 + w3
        else:
            y3 = y3.to(DTYPE).to(tl.float32)
        y3 = y3 * w3
    return y1 * w1, y2 * w2, y3


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, qw_ptr, kw_ptr,
    stride_xt, stride_xh, stride_cp,
    T, num_heads, num_q_heads, HALF, REST, head_dim, max_pos, eps,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, HAS_REST: tl.constexpr, QK_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    # heads [0, num_q_heads) are q's (their norm weight), the rest k's
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    offs_r = tl.arange(0, BLOCK_REST)
    mask_t = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    ok_t = mask_t & (pos >= 0) & (pos < max_pos)  # (outside the table: the row is left as is)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, pos, ok_t, stride_cp, offs_d, HALF)
    mask = ok_t[:, None] & (offs_h < num_heads)[None, :]
    ptrs = x_ptr + offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * stride_xh
    x1, x2, x3 = _load_parts(ptrs, mask, offs_d, offs_r, HALF, REST, HAS_REST)
    if QK_NORM:
        x1, x2, x3 = _norm_parts(x1, x2, x3, (offs_h < num_q_heads)[None, :, None], qw_ptr,
                                 kw_ptr, offs_d, offs_r, HALF, REST, head_dim, eps, HAS_REST,
                                 UNIT_OFFSET, x_ptr.dtype.element_ty)
    _store_parts(ptrs, x1 * cos - x2 * sin, x2 * cos + x1 * sin, x3, mask, offs_d, offs_r, HALF,
                 REST, HAS_REST)


def _check_table(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    """The rotary half-width the cos/sin tables imply (checked against head_dim)."""
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.stride() == sin.stride()
          and cos.stride(1) == 1, "cos/sin must be [max_pos, rotary_dim / 2] with equal strides")
    half = cos.shape[1]
    check(0 < 2 * half <= head_dim, f"cos/sin are {half} wide: rotary_dim {2 * half} must be in "
          f"(0, head_dim={head_dim}]")
    return half


def _check_norm(qk_norm: QKNorm | None, head_dim: int, device: torch.device) -> None:
    if qk_norm is not None:
        for w in (qk_norm.q_weight, qk_norm.k_weight):
            check(w.shape == (head_dim,) and w.stride(0) == 1 and w.device == device,
                  f"q/k norm weights must be contiguous [{head_dim}]")


def _norm_args(qk_norm: QKNorm | None, fallback: torch.Tensor) -> tuple:
    if qk_norm is None:
        return fallback, fallback, 0.0
    return qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.eps)


def _launch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            num_heads: int, num_q_heads: int, qk_norm: QKNorm | None) -> None:
    T, _, Dh = x.shape
    half = cos.shape[1]
    rest = Dh - 2 * half
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_h = next_pow2(num_heads) if INTERPRET else min(next_pow2(num_heads), 16)
    grid = (cdiv(T, block_t), cdiv(num_heads, block_h))
    launch(_rotary_kernel, grid, x, cos, sin, positions, *_norm_args(qk_norm, cos)[:2],
           x.stride(0), x.stride(1), cos.stride(0), T, num_heads, num_q_heads, half, rest, Dh,
           cos.shape[0], _norm_args(qk_norm, cos)[2],
           BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half),
           BLOCK_REST=next_pow2(max(rest, 1)), HAS_REST=rest > 0, QK_NORM=qk_norm is not None,
           UNIT_OFFSET=bool(qk_norm and qk_norm.unit_offset))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, qk_norm: QKNorm | None = None) -> None:
    """q: [T, Hq, Dh], k: [T, Hk, Dh] normalized (``qk_norm``) and rotated in place;
    positions: [T]; cos, sin: [P, rotary_dim / 2] fp32.

    When k directly follows q in memory (the fused qkv projection) both are one launch.
    """
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, head_dim]")
    T, Hq, Dh = q.shape
    check(k.shape[0] == T and k.shape[2] == Dh, "k must be [T, Hk, head_dim] like q")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q and k need unit stride along head_dim")
    check(q.dtype == k.dtype, "q and k must share a dtype")
    check(positions.shape == (T,), "positions must be [T]")
    _check_table(cos, sin, Dh)
    _check_norm(qk_norm, Dh, q.device)
    if T == 0:
        return
    # (one token: torch gives the size-1 token dimension whatever stride it likes, so the
    # views of one fused qkv row differ there; that stride is never used)
    adjacent = ((T == 1 or q.stride(0) == k.stride(0)) and q.stride(1) == k.stride(1) == Dh
                and k.data_ptr() == q.data_ptr() + Hq * Dh * q.element_size())
    if adjacent:
        _launch(q, positions, cos, sin, Hq + k.shape[1], Hq, qk_norm)
    else:
        _launch(q, positions, cos, sin, Hq, Hq, qk_norm)
        _launch(k, positions, cos, sin, k.shape[1], 0, qk_norm)


@triton.jit
def _rotary_kv_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    qw_ptr, kw_ptr,
    stride_xt, stride_cp, T, num_q_heads, num_kv_heads, head_dim, HALF, REST, max_pos, num_slots,
    eps,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, HAS_REST: tl.constexpr, QUANT: tl.constexpr,
    QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    # Heads of the fused qkv row: [0, Hq) q, normalized and rotated in place; [Hq, Hq + Hk) k,
    # normalized and rotated into the cache; [Hq + Hk, Hq + 2Hk) v, copied into the cache.
    # One pass, one launch.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    offs_r = tl.arange(0, BLOCK_REST)
    mask_t = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    rot_t = mask_t & (pos >= 0) & (pos < max_pos)
    kv_t = mask_t & (slot >= 0) & (slot < num_slots)
    # a position outside the table rotates by nothing: q stays, k is cached as it is - what
    # apply_rotary (which skips such rows) then write_kv_cache would do
    cos, sin = _cos_sin(cos_ptr, sin_ptr, pos, rot_t, stride_cp, offs_d, HALF)
    h_q = offs_h < num_q_heads
    h_k = (offs_h >= num_q_heads) & (offs_h < num_q_heads + num_kv_heads)
    h_v = (offs_h >= num_q_heads + num_kv_heads) & (offs_h < num_q_heads + 2 * num_kv_heads)
    ptrs = x_ptr + offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * head_dim
    x1, x2, x3 = _load_parts(ptrs, mask_t[:, None] & (h_q | h_k | h_v)[None, :], offs_d, offs_r,
                             HALF, REST, HAS_REST)
    is_k, is_v = h_k[None, :, None], h_v[None, :, None]
    if QK_NORM:  # (v heads keep their raw values: they are selected back below)
        n1, n2, n3 = _norm_parts(x1, x2, x3, h_q[None, :, None], qw_ptr, kw_ptr, offs_d, offs_r,
                                 HALF, REST, head_dim, eps, HAS_REST, UNIT_OFFSET,
                                 x_ptr.dtype.element_ty)
        x1, x2 = tl.where(is_v, x1, n1), tl.where(is_v, x2, n2)
        if HAS_REST:
            x3 = tl.where(is_v, x3, n3)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    _store_parts(ptrs, r1, r2, x3, rot_t[:, None] & h_q[None, :], offs_d, offs_r, HALF, REST,
                 HAS_REST)
    # k rotated and v as loaded, into the cache at the token's slot
    y1, y2 = tl.where(is_k, r1, x1), tl.where(is_k, r2, x2)
    kv_head = tl.where(h_k, offs_h - num_q_heads, offs_h - num_q_heads - num_kv_heads)
    dst = slot[:, None, None] * (num_kv_heads * head_dim) + kv_head[None, :, None] * head_dim
    k_mask = kv_t[:, None] & h_k[None, :]
    v_mask = kv_t[:, None] & h_v[None, :]
    if QUANT:  # a head's whole vector is in this program: its scale is a register max
        y1, y2, x3 = finite_or_zero(y1, tl.float32), finite_or_zero(y2, tl.float32), \
            finite_or_zero(x3, tl.float32)
        c1, c2, c3, scale = quantize_kv(y1, y2, x3, HAS_REST)
        s_dst = slot[:, None] * num_kv_heads + kv_head[None, :]
        _store_parts(k_cache_ptr + dst, c1, c2, c3, k_mask, offs_d, offs_r, HALF, REST, HAS_REST)
        tl.store(k_scale_ptr + s_dst, scale, mask=k_mask)
        _store_parts(v_cache_ptr + dst, c1, c2, c3, v_mask, offs_d, offs_r, HALF, REST, HAS_REST)
        tl.store(v_scale_ptr + s_dst, scale, mask=v_mask)
    else:
        dt = k_cache_ptr.dtype.element_ty
        y1, y2, x3 = finite_or_zero(y1, dt), finite_or_zero(y2, dt), finite_or_zero(x3, dt)
        _store_parts(k_cache_ptr + dst, y1, y2, x3, k_mask, offs_d, offs_r, HALF, REST, HAS_REST)
        _store_parts(v_cache_ptr + dst, y1, y2, x3, v_mask, offs_d, offs_r, HALF, REST, HAS_REST)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        qk_norm: QKNorm | None = None) -> None:
    """``apply_rotary(q, k, qk_norm)`` then ``write_kv_cache(k, v)``, as one launch when q, k
    and v are adjacent heads of one fused qkv row (the model's layout); two launches otherwise.
    k itself is left unrotated in the fused case: only its cache copy is read afterwards.
    An int8 cache takes k_scale / v_scale (see kv_cache.py): quantized as it is written."""
    T, Hq, Dh = q.shape
    Hk = k.shape[1]
    es = q.element_size()
    fused = (q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape == (T, Hk, Dh)
             and q.dtype == k.dtype == v.dtype and q.stride(2) == k.stride(2) == v.stride(2) == 1
             and q.stride(1) == k.stride(1) == v.stride(1) == Dh
             and (T == 1 or q.stride(0) == k.stride(0) == v.stride(0))
             and k.data_ptr() == q.data_ptr() + Hq * Dh * es
             and v.data_ptr() == k.data_ptr() + Hk * Dh * es)
    if not fused:
        apply_rotary(q, k, positions, cos, sin, qk_norm)
        write_kv_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return
    half = _check_table(cos, sin, Dh)
    _check_norm(qk_norm, Dh, q.device)
    check(positions.shape == (T,) and slots.shape == (T,), "positions and slots must be [T]")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, Dh)
          and k_cache.is_contiguous() and v_cache.is_contiguous(),
          f"caches must be contiguous [num_blocks, block_size, {Hk}, {Dh}]")
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if T == 0:
        return
    heads = Hq + 2 * Hk
    rest = Dh - 2 * half
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_h = next_pow2(heads) if INTERPRET else min(next_pow2(heads), 16)
    qw, kw, eps = _norm_args(qk_norm, cos)
    launch(_rotary_kv_kernel, (cdiv(T, block_t), cdiv(heads, block_h)),
           q, cos, sin, positions, slots, k_cache, v_cache,
           k_scale if quantized else k_cache, v_scale if quantized else v_cache, qw, kw,
           q.stride(0) if T > 1 else heads * Dh,
           cos.stride(0), T, Hq, Hk, Dh, half, rest, cos.shape[0],
           k_cache.shape[0] * k_cache.shape[1], eps,
           BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half),
           BLOCK_REST=next_pow2(max(rest, 1)), HAS_REST=rest > 0, QUANT=quantized,
           QK_NORM=qk_norm is not None, UNIT_OFFSET=bool(qk_norm and qk_norm.unit_offset))
