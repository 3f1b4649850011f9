"""int4 experts for moe.py's grouped GEMMs: group_matmul.py's int4 format per expert (codes
8 to an int32 word along K, a float scale and a uint8 zero point per group), and the K loop
that dequantizes one group step at a time in registers: W = (q - zero) * scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinyserve.kernels.group_matmul import _codes, _group_params
from tinyserve.kernels.utils import check


@dataclass(frozen=True, slots=True)
class Int4Experts:
    """Stacked experts in group_matmul.py's int4 format: ``qweight`` [E, N, K_pad / 8] int32
    (8 codes a word along K, low nibble first), ``scales`` [E, N, K_pad / G] float, ``zeros``
    [E, N, K_pad / G] uint8 (the same strides as scales); W = (q - zero) * scale."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    in_features: int  # K (the codes hold K_pad = whole groups)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.qweight.shape[:2], self.in_features)

    def checked_parts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(scales, zeros, group size, K_pad) once every part is what the GEMM reads, on
        ``device``; ValueError naming what is not."""
        q, E, N, K, G = self.qweight, *self.shape, self.group_size
        check(q.dim() == 3, "int4 experts: qweight must be [E, N, K_pad / 8]")
        K_pad = q.shape[2] * 8
        check(q.dtype == torch.int32 and q.device == self.scales.device == self.zeros.device
              == device and G >= 16 and G & (G - 1) == 0 and K_pad % G == 0
              and K <= K_pad < K + G,
              f"int4 experts: qweight must be int32 [E, N, K_pad / 8] on the activations' "
              f"device, K_pad = whole groups of a power-of-two size >= 16 (K {K}, G {G})")
        check(self.scales.shape == (E, N, K_pad // G) and self.scales.dtype.is_floating_point
              and self.zeros.shape == self.scales.shape and self.zeros.dtype == torch.uint8
              and self.zeros.stride() == self.scales.stride(),
              f"int4 experts: scales (float) and zeros (uint8) must be [{E}, {N}, "
              f"{K_pad // G}] with the same strides")
        return self.scales, self.zeros, G, K_pad

    def dequantized(self) -> torch.Tensor:
        """The fp32 [E, N, K] the GEMM multiplies by (a reference: tests, debugging)."""
        from tinyserve.kernels.int4_pack import dequantize_int4

        return torch.stack([dequantize_int4(self.qweight[e], self.scales[e], self.zeros[e],
                                            self.group_size, self.in_features)
                            for e in range(self.qweight.shape[0])])


@triton.jit
def _int4_tile(q_ptrs, s_ptr, z_ptr, rows, mask_n, g, n_groups, stride_sn, stride_sg,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_K] weights (q - z) * s of one group step, fp32; s_ptr / z_ptr at the
    expert (zeros share the scales' strides)."""
    q = _codes(q_ptrs, mask_n[:, None], 4, BLOCK_K)
    sc = _group_params(s_ptr, rows, mask_n, g, n_groups, stride_sn, stride_sg, 0.0,
                       BLOCK_N, BLOCK_K, GROUP)
    z = _group_params(z_ptr, rows, mask_n, g, n_groups, stride_sn, stride_sg, 0,
                      BLOCK_N, BLOCK_K, GROUP)
    return q * sc - z * sc


@triton.jit
def _k_loop_int4(a_rows, q_ptr, s_ptr, z_ptr, w_rows, up_off, rows, mask_n, K, K_pad,
                 stride_ak, stride_wn, stride_wk, stride_sn, stride_sg,
                 GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_PREC: tl.constexpr):
    """_k_loop over int4 codes (q_ptr, s_ptr, z_ptr at the expert): K_pad in BLOCK_K steps
    inside a group each (BLOCK_K <= GROUP); a masked at its real K."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8).to(tl.int64)
    a_ptrs = a_rows + offs_k[None, :] * stride_ak
    q_ptrs = q_ptr + w_rows[:, None] * stride_wn + offs_w[None, :] * stride_wk
    n_groups = K_pad // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_pad, BLOCK_K):
        g = k // GROUP
        a = tl.load(a_ptrs, mask=rows[:, None] & ((offs_k + k) < K)[None, :], other=0.0)
        w = _int4_tile(q_ptrs, s_ptr, z_ptr, w_rows, mask_n, g, n_groups, stride_sn,
                       stride_sg, BLOCK_N, BLOCK_K, GROUP)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PREC)
        if GATED:
            w = _int4_tile(q_ptrs + up_off * stride_wn, s_ptr, z_ptr, w_rows + up_off, mask_n,
                           g, n_groups, stride_sn, stride_sg, BLOCK_N, BLOCK_K, GROUP)
            acc_up = tl.dot(a, tl.trans(w.to(a.dtype)), acc_up, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        q_ptrs += (BLOCK_K // 8) * stride_wk
    return acc, acc_up
