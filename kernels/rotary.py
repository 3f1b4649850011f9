"""Rotary position embedding, Llama "rotate-half" convention, applied in place to q and k.

For each token t at position p = positions[t], each head, and i < HALF = head_dim / 2:

    x1, x2 = x[i], x[i + HALF]
    x[i]        = x1 * cos[p, i] - x2 * sin[p, i]
    x[i + HALF] = x2 * cos[p, i] + x1 * sin[p, i]

``cos``/``sin`` [max_pos, HALF] fp32 are precomputed at load time from the (possibly llama3-
scaled) inverse frequencies, so scaling lives in the table, not in the kernel.
Layouts: q [T, Hq, head_dim], k [T, Hk, head_dim] (unit stride along head_dim; usually strided
views of one fused qkv projection); positions [T] int.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.kv_cache import check_kv_scales, quantize_kv, write_kv_cache
from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch, next_pow2


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, ok, stride_cp, offs_d, HALF):
    """cos, sin [BLOCK_T, 1, BLOCK_HALF] for each token's position; a masked-out token (or a
    position outside the table) rotates by nothing: cos 1, sin 0."""
    cs_mask = ok[:, None] & (offs_d < HALF)[None, :]
    cs_off = pos[:, None] * stride_cp + offs_d[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0)[:, None, :]
    sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)[:, None, :]
    return cos, sin, cs_mask


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_xt, stride_xh, stride_cp,
    T, num_heads, HALF, max_pos,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_t = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    mask_t = mask_t & (pos >= 0) & (pos < max_pos)
    cos, sin, cs_mask = _cos_sin(cos_ptr, sin_ptr, pos, mask_t, stride_cp, offs_d, HALF)
    # Both halves of a pair sit in the same thread's registers, so rotating in place is race-free.
    ptrs = x_ptr + offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * stride_xh \
        + offs_d[None, None, :]
    mask = cs_mask[:, None, :] & (offs_h < num_heads)[None, :, None]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            num_heads: int) -> None:
    T, _, Dh = x.shape
    half = Dh // 2
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_h = next_pow2(num_heads) if INTERPRET else min(next_pow2(num_heads), 16)
    grid = (cdiv(T, block_t), cdiv(num_heads, block_h))
    launch(_rotary_kernel, grid, x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0),
                         T, num_heads, half, cos.shape[0],
                         BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q: [T, Hq, Dh], k: [T, Hk, Dh] rotated in place; positions: [T]; cos, sin: [P, Dh/2] fp32.

    When k directly follows q in memory (the fused qkv projection) both are one launch.
    """
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, head_dim]")
    T, Hq, Dh = q.shape
    check(k.shape[0] == T and k.shape[2] == Dh, "k must be [T, Hk, head_dim] like q")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q and k need unit stride along head_dim")
    check(q.dtype == k.dtype, "q and k must share a dtype")
    check(Dh % 2 == 0, f"head_dim must be even, got {Dh}")
    check(positions.shape == (T,), "positions must be [T]")
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == Dh // 2
          and cos.stride() == sin.stride() and cos.stride(1) == 1,
          f"cos/sin must be [max_pos, {Dh // 2}] with equal strides")
    if T == 0:
        return
    # (one token: torch gives the size-1 token dimension whatever stride it likes, so the
    # views of one fused qkv row differ there; that stride is never used)
    adjacent = ((T == 1 or q.stride(0) == k.stride(0)) and q.stride(1) == k.stride(1) == Dh
                and k.data_ptr() == q.data_ptr() + Hq * Dh * q.element_size())
    if adjacent:
        _launch(q, positions, cos, sin, Hq + k.shape[1])
    else:
        _launch(q, positions, cos, sin, Hq)
        _launch(k, positions, cos, sin, k.shape[1])


@triton.jit
def _rotary_kv_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_xt, stride_cp, T, num_q_heads, num_kv_heads, head_dim, HALF, max_pos, num_slots,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr,
):
    # Heads of the fused qkv row: [0, Hq) q, rotated in place; [Hq, Hq + Hk) k, rotated into
    # the cache; [Hq + Hk, Hq + 2Hk) v, copied into the cache. One pass, one launch.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_t = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    rot_t = mask_t & (pos >= 0) & (pos < max_pos)
    kv_t = mask_t & (slot >= 0) & (slot < num_slots)
    d_ok = (offs_d < HALF)[None, None, :]
    # a position outside the table rotates by nothing: q stays, k is cached as it is - what
    # apply_rotary (which skips such rows) then write_kv_cache would do
    cos, sin, _ = _cos_sin(cos_ptr, sin_ptr, pos, rot_t, stride_cp, offs_d, HALF)
    h_k = (offs_h >= num_q_heads) & (offs_h < num_q_heads + num_kv_heads)
    h_v = (offs_h >= num_q_heads + num_kv_heads) & (offs_h < num_q_heads + 2 * num_kv_heads)
    is_q = (offs_h < num_q_heads)[None, :, None]
    is_k = h_k[None, :, None]
    is_v = h_v[None, :, None]
    ptrs = x_ptr + offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * head_dim \
        + offs_d[None, None, :]
    load_mask = mask_t[:, None, None] & d_ok & (is_q | is_k | is_v)
    x1 = tl.load(ptrs, mask=load_mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=load_mask, other=0.0).to(tl.float32)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    q_mask = rot_t[:, None, None] & d_ok & is_q
    tl.store(ptrs, r1.to(x_ptr.dtype.element_ty), mask=q_mask)
    tl.store(ptrs + HALF, r2.to(x_ptr.dtype.element_ty), mask=q_mask)
    kv_head = tl.where(h_k, offs_h - num_q_heads, offs_h - num_q_heads - num_kv_heads)
    dst = slot[:, None, None] * (num_kv_heads * head_dim) + kv_head[None, :, None] * head_dim \
        + offs_d[None, None, :]
    k_mask = kv_t[:, None, None] & d_ok & is_k
    v_mask = kv_t[:, None, None] & d_ok & is_v
    if QUANT:  # a head's whole vector is in this program: its scale is a register max
        c1, c2, scale = quantize_kv(tl.where(is_k, r1, x1), tl.where(is_k, r2, x2))
        s_dst = slot[:, None] * num_kv_heads + kv_head[None, :]
        tl.store(k_cache_ptr + dst, c1, mask=k_mask)
        tl.store(k_cache_ptr + dst + HALF, c2, mask=k_mask)
        tl.store(k_scale_ptr + s_dst, scale, mask=kv_t[:, None] & h_k[None, :])
        tl.store(v_cache_ptr + dst, c1, mask=v_mask)
        tl.store(v_cache_ptr + dst + HALF, c2, mask=v_mask)
        tl.store(v_scale_ptr + s_dst, scale, mask=kv_t[:, None] & h_v[None, :])
    else:
        tl.store(k_cache_ptr + dst, r1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_cache_ptr + dst + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(v_cache_ptr + dst, x1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
        tl.store(v_cache_ptr + dst + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """``apply_rotary(q, k)`` then ``write_kv_cache(k, v)``, as one launch when q, k and v are
    adjacent heads of one fused qkv row (the model's layout); two launches otherwise.
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
        apply_rotary(q, k, positions, cos, sin)
        write_kv_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return
    check(Dh % 2 == 0, f"head_dim must be even, got {Dh}")
    check(positions.shape == (T,) and slots.shape == (T,), "positions and slots must be [T]")
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == Dh // 2
          and cos.stride() == sin.stride() and cos.stride(1) == 1,
          f"cos/sin must be [max_pos, {Dh // 2}] with equal strides")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, Dh)
          and k_cache.is_contiguous() and v_cache.is_contiguous(),
          f"caches must be contiguous [num_blocks, block_size, {Hk}, {Dh}]")
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if T == 0:
        return
    heads = Hq + 2 * Hk
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_h = next_pow2(heads) if INTERPRET else min(next_pow2(heads), 16)
    half = Dh // 2
    launch(_rotary_kv_kernel, (cdiv(T, block_t), cdiv(heads, block_h)),
           q, cos, sin, positions, slots, k_cache, v_cache,
           k_scale if quantized else k_cache, v_scale if quantized else v_cache,
           q.stride(0) if T > 1 else heads * Dh,
           cos.stride(0), T, Hq, Hk, Dh, half, cos.shape[0], k_cache.shape[0] * k_cache.shape[1],
           BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), QUANT=quantized)
