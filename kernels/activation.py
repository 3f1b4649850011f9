"""Gated activations of the MLP: ``out = act(x[:, :I]) * x[:, I:]``.

x is the output of the fused gate/up projection [T, 2I] (gate rows first, then up rows);
out is [T, I]. ``act`` is SiLU (Llama, Qwen, Mistral, Phi-3: SwiGLU) or GELU with the tanh
approximation (Gemma: GeGLU, transformers' ``gelu_pytorch_tanh``):

    gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))

Computed in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.jitmath import tanh
from tinyserve.kernels.utils import INTERPRET, cdiv, check, empty, launch, next_pow2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, stride_ot, T, I,
    GELU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_i < I)[None, :]
    row = x_ptr + offs_t[:, None] * stride_xt + offs_i[None, :]
    gate = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + I, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + tanh(inner)) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_i[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """x: [T, 2I] -> out: [T, I] = act(gate) * up; ``activation`` "silu" or "gelu_tanh"."""
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1,
          "x must be [T, 2I] with unit column stride")
    T, I = x.shape[0], x.shape[1] // 2
    if out is None:
        out = empty((T, I), x.dtype, x.device)
    check(out.shape == (T, I) and out.stride(1) == 1, f"out must be [{T}, {I}]")
    if T == 0:
        return out
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_i = min(next_pow2(I), 16384 if INTERPRET else 2048)
    grid = (cdiv(T, block_t), cdiv(I, block_i))
    launch(_silu_and_mul_kernel, grid, x, out, x.stride(0), out.stride(0), T, I,
           GELU=activation == "gelu_tanh", BLOCK_T=block_t, BLOCK_I=block_i)
    return out
