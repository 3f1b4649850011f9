"""Fused residual add + RMSNorm.

    r   = x + residual            (written back into ``residual``; skipped when it is None)
    out = weight * (r / sqrt(mean(r^2) + eps))

Statistics in fp32; the normalized value is rounded to the model dtype before the weight
multiply, as transformers' LlamaRMSNorm does. ``unit_offset`` (Gemma): the weight is stored as
w - 1, so out = (r / rms) * (1 + w), multiplied in fp32 and rounded once, as Gemma2RMSNorm does.
Layouts: x, residual, out [T, D] (unit column stride); weight [D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, empty, launch, next_pow2


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_xt, stride_rt, stride_ot,
    T, D, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_d[None, :], mask=mask, other=0.0)
    r = x.to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + offs_t[:, None] * stride_rt + offs_d[None, :]
        r = r + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptrs, r.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(r * r, axis=1) / D + eps)
    normed = r * rstd[:, None]
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = 1.0 + w
    else:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_d[None, :],
             (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                unit_offset: bool = False) -> torch.Tensor:
    """x: [T, D]; weight: [D]; residual: [T, D] or None (updated in place to x + residual).

    Returns out: [T, D], the normalized (x + residual), times weight (``unit_offset``: times
    1 + weight, Gemma's convention).
    """
    check(x.dim() == 2 and x.stride(1) == 1, "x must be [T, D] with unit column stride")
    T, D = x.shape
    check(weight.shape == (D,), f"weight must be [{D}], got {tuple(weight.shape)}")
    if residual is not None:
        check(residual.shape == x.shape and residual.stride(1) == 1, "residual must match x")
    if out is None:
        out = empty(x.shape, x.dtype, x.device)
    check(out.shape == x.shape and out.stride(1) == 1, "out must match x")
    if T == 0:
        return out
    block_d = next_pow2(D)
    check(block_d <= 65536, f"hidden size {D} is too large for a single-block RMSNorm")
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    res = residual if residual is not None else x
    launch(_add_rmsnorm_kernel, (cdiv(T, block_t),),
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), T, D, eps,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 4096 else 8)
    return out
