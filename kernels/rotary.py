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

from tinyserve.kernels.utils import INTERPRET, check, next_pow2


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, offs_t, mask_t, num_heads, cos, sin,
                  HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    ptrs = x_ptr + offs_t[:, None, None] * stride_t + offs_h[None, :, None] * stride_h \
        + offs_d[None, None, :]
    mask = mask_t[:, None, None] & (offs_h < num_heads)[None, :, None] \
        & (offs_d < HALF)[None, None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    tl.store(ptrs, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cp,
    T, num_q_heads, num_k_heads, HALF, max_pos,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    mask_t = offs_t < T
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    mask_t = mask_t & (pos >= 0) & (pos < max_pos)
    offs_d = tl.arange(0, BLOCK_HALF)
    cs_mask = mask_t[:, None] & (offs_d < HALF)[None, :]
    cos = tl.load(cos_ptr + pos[:, None] * stride_cp + offs_d[None, :], mask=cs_mask, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * stride_cp + offs_d[None, :], mask=cs_mask, other=0.0)
    _rotate_heads(q_ptr, stride_qt, stride_qh, offs_t, mask_t, num_q_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, offs_t, mask_t, num_k_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q: [T, Hq, Dh], k: [T, Hk, Dh] rotated in place; positions: [T]; cos, sin: [P, Dh/2] fp32."""
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, head_dim]")
    T, Hq, Dh = q.shape
    check(k.shape[0] == T and k.shape[2] == Dh, "k must be [T, Hk, head_dim] like q")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q and k need unit stride along head_dim")
    check(Dh % 2 == 0, f"head_dim must be even, got {Dh}")
    check(positions.shape == (T,), "positions must be [T]")
    check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == Dh // 2
          and cos.stride() == sin.stride() and cos.stride(1) == 1,
          f"cos/sin must be [max_pos, {Dh // 2}] with equal strides")
    if T == 0:
        return
    half = Dh // 2
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    _rotary_kernel[(triton.cdiv(T, block_t),)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        T, Hq, k.shape[1], half, cos.shape[0],
        BLOCK_T=block_t, BLOCK_HQ=next_pow2(Hq), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half))
