"""Int4 weight-only linear layer, group-wise: ``y = x @ W.T``, W dequantized in registers.

    g = k // group_size
    W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]        q in [0, 15] (a 4-bit code)
    y[m, n] = sum_k x[m, k] * W[n, k]                     fp32 accumulator, y in x's dtype
    symmetric (zeros=None): zero = 8, i.e. signed int4 values q - 8 in [-8, 7]

Layouts (G = group_size, K_pad = ceil(K / G) * G: K in whole groups):
    x        [M, K]           fp16 / bf16 / fp32
    qweight  [N, K_pad // 8]  int32, packed along K, low nibble first:
                              word w of row n = | q[n,8w+7] | ... | q[n,8w+1] | q[n,8w] |
                                                bits 31..28          7..4       3..0
    scales   [N, K_pad // G]  fp32 / fp16 / bf16 (any strides: a [K_pad // G, N] tensor's .T works)
    zeros    [N, K_pad // G]  int or float, the zero point itself: not scaled, not packed

K need not be a multiple of G (stories260k has K = 64 and 172): the last group is partial and
its codes past K are padding. quantize_int4 takes that group's statistics from its real columns
and writes the zero-point code into the padding (so the padded W is exactly 0), and the kernel
masks x past K, so the padding never reaches a sum whatever it holds.

Why these conventions: GPTQ and AWQ both define W = (q - z) * s with integer z, so their
loaders only unpack (and transpose / de-interleave) into this layout; a float z (HQQ-style,
fractional) works too. Packing along K makes a K tile of a row BLOCK_K / 8 consecutive words:
one vector load, each word repeated 8x along K in registers (tl.interleave) and shifted by
4 * (k % 8). NOTE: measured with ptxas (sm_90, bf16, 64x128x64 tile, zeros): interleave keeps
a row's 32 consecutive k in one thread and needs 128 registers; the same unpack written as a
[BLOCK_N, BLOCK_K / 8, 8] broadcast + reshape got a 1-element-per-thread layout, 254
registers, and spills. Each K tile lies inside one group (BLOCK_K divides G), so a tile's
scales and zeros are one [BLOCK_N] vector each and fold into w = q * s + b with b = -z * s:
one FMA per weight. That is exact up to fp32 rounding of z * s (|err| <= 2^-24 * |z * s|, far
below the fp16 / bf16 cast that follows). q itself becomes a float through the bits of
2^23 + q rather than an int->float conversion (16 per SM per clock on sm_90 against 128 fp32
adds, per the CUDA guide's throughput table: at decode it would cost more than the memory).
On the interpreter use fp32 or fp16 x: its bf16 tl.dot is wrong (see TRITON_ON_CPU.md).

Cost: 2*M*N*K FLOPs; bytes ~ M*K*x + N*K/2 (+ 2 * N*K/G * s) + M*N*y: a quarter of fp16's
weight bytes at decode. Tile sizes depend on (N, K, G, dtype), never on M, and split-K follows
matmul.py (same policy, same chunk order): a row's result is the same whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.matmul import check_epilogue, epilogue, split_plan, sum_split_k, tile_offsets
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2


@triton.jit
def _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, k_lo, k_hi,
             stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
             K, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """sum_{k_lo <= k < k_hi} x[m, k] * W[n, k] for one tile, fp32, from zero. k_lo and k_hi are
    multiples of BLOCK_K, which divides GROUP: each K tile is in one group, and the weights need
    no K mask (qweight holds whole groups). x is masked at its real K (padding: docstring)."""
    offs_k = k_lo + tl.arange(0, BLOCK_K).to(tl.int64)
    offs_w = k_lo // 8 + tl.arange(0, BLOCK_K // 8).to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :] * stride_qk  # [BLOCK_N, BLOCK_K/8]
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4  # nibble j of a word holds k = 8 * word + j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        g = k // GROUP
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] + (k - k_lo) < K), other=0.0)
        words = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=mask_n, other=0).to(tl.float32)
        else:
            z = 8.0
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)  # [BLOCK_N, BLOCK_K]: column k holds word k // 8
        # the float 2^23 + q has q in its low mantissa bits: subtracting 2^23 gives q exactly
        nib = ((words >> shifts[None, :]) & 0xF) | 0x4B000000
        q = nib.to(tl.float32, bitcast=True) - 8388608.0
        w = q * s[:, None] - (z * s)[:, None]  # [BLOCK_N, BLOCK_K] = (q - z) * s
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += (BLOCK_K // 8) * stride_qk
    return acc


@triton.jit
def _int4_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, softcap,
    M, N, K, K_pad, k_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on, stride_os,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    SPLIT_GRID: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # K: x's columns (the mask); K_pad: qweight's, whole groups (the loop bound).
    # (grouped order, as in matmul.py: GROUP_M row tiles share weight tiles in L2)
    offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # SPLIT_K chunks of k_split, each summed from zero, added in order: in separate programs
    # (SPLIT_GRID: partials summed by matmul.py's _split_k_sum_kernel) or one after another
    # here - the same fp32 operations either way (see matmul.py).
    if SPLIT_GRID:
        pid_k = tl.program_id(2 if GROUP_M == 1 else 1).to(tl.int64)
        k_lo = pid_k * k_split
        acc = _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, k_lo,
                       tl.minimum(K_pad, k_lo + k_split), stride_xm, stride_xk, stride_qn, stride_qk,
                       stride_sn, stride_sg, stride_zn, stride_zg, K,
                       GROUP, HAS_ZEROS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        tl.store(out_ptr + offs_m[:, None] * stride_om + pid_k * stride_os
                 + offs_n[None, :] * stride_on, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        acc = _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, 0,
                       tl.minimum(K_pad, k_split), stride_xm, stride_xk, stride_qn, stride_qk,
                       stride_sn, stride_sg, stride_zn, stride_zg, K,
                       GROUP, HAS_ZEROS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        for c in range(1, SPLIT_K):  # (not unrolled: one chunk's registers at a time)
            acc += _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n,
                            c * k_split, tl.minimum(K_pad, (c + 1) * k_split), stride_xm,
                            stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn,
                            stride_zg, K, GROUP, HAS_ZEROS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        acc = epilogue(acc, bias_ptr, offs_n, mask_n, softcap, HAS_BIAS, SOFTCAP)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(N: int, K: int, group_size: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M); BLOCK_K is capped by the largest power of two
    dividing group_size, so that a K tile never straddles two groups."""
    g_pow2 = group_size & -group_size
    if INTERPRET:  # few, large programs: cost is ~ programs x ops, not FLOPs
        return 64, min(512, max(16, next_pow2(N))), min(256, max(16, next_pow2(K)), g_pow2), 1
    if dtype == torch.float32:  # ieee fp32 runs on FMA units: smaller tiles avoid spills
        return 32, 64, min(32, g_pow2), 8
    # 128-wide K steps as for int8 (a step reads only 64 B of a weight row); no spills at
    # Llama-3-8B shapes (ptxas: 132-212 registers). Not yet timed on a GPU.
    return 64, 128, min(128, g_pow2), 8


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None = None, group_size: int = 128, *,
                out: torch.Tensor | None = None, split_k: int | None = None,
                split_grid: bool | None = None, bias: torch.Tensor | None = None,
                softcap: float | None = None) -> torch.Tensor:
    """x: [M, K] float, qweight: [N, K_pad // 8] int32, scales / zeros: [N, K_pad // group_size]
    with K_pad = ceil(K / group_size) * group_size -> out: [M, N] = x @ W.T (layout and formula:
    module docstring), + bias [N] and soft-capped as ``matmul`` does. ``split_k`` and
    ``split_grid`` as in ``matmul``: chosen per (N, K) by default, never by M."""
    check(x.dim() == 2 and qweight.dim() == 2, "x must be [M, K] and qweight [N, K_pad // 8]")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"x must be fp16, bf16 or fp32, got {x.dtype}")
    check(qweight.dtype == torch.int32, f"qweight must be int32 (8 nibbles a word), got {qweight.dtype}")
    M, K = x.shape
    N = qweight.shape[0]
    check(group_size > 0 and group_size % 16 == 0,
          f"group_size must be a positive multiple of 16 (the smallest K tile), got {group_size}")
    K_pad = qweight.shape[1] * 8
    check(K_pad % group_size == 0, f"qweight holds {K_pad} codes a row: not whole groups of "
          f"group_size={group_size}")
    check(cdiv(K, group_size) * group_size == K_pad,
          f"inner sizes differ: x is [{M}, {K}], qweight is {list(qweight.shape)} (K_pad // 8 "
          f"words, K_pad = K rounded up to a multiple of group_size={group_size})")
    groups = (N, K_pad // group_size)
    check(scales.shape == groups, f"scales must be [N, K_pad // group_size] = {list(groups)}, "
          f"got {list(scales.shape)}")
    check(scales.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"scales must be fp16, bf16 or fp32, got {scales.dtype}")
    if zeros is not None:
        check(zeros.shape == groups, f"zeros must be [N, K_pad // group_size] = {list(groups)}, "
              f"got {list(zeros.shape)}")
        check(zeros.dtype != torch.bool and not zeros.is_complex(), f"bad zeros dtype {zeros.dtype}")
    check(all(t.device == x.device for t in (qweight, scales, zeros) if t is not None),
          "x, qweight, scales and zeros must be on the same device")
    check_epilogue(bias, softcap, N, x.device)
    if out is None:
        out = empty((M, N), x.dtype, x.device)
    check(out.shape == (M, N) and out.dtype.is_floating_point, f"out must be a float [{M}, {N}]")
    if M == 0:
        return out

    bm, bn, bk, group_m = _tiles(N, K_pad, group_size, x.dtype)
    tiles, split_k, split_grid, k_split = split_plan(M, N, K_pad, bm, bn, bk, x.device, split_k,
                                                     split_grid)
    grid = tiles if group_m == 1 else (tiles[0] * tiles[1],)
    target, t_strides = out, (out.stride(0), out.stride(1), 0)
    if split_grid:  # [M, split, N] fp32 partial sums, as in matmul.py
        grid += (split_k,)
        target = empty((M, split_k, N), torch.float32, x.device)
        t_strides = (target.stride(0), target.stride(2), target.stride(1))
    z = scales if zeros is None else zeros  # (never read without zeros)
    launch(_int4_matmul_kernel, grid,
           x, qweight, scales, z, scales if bias is None else bias, target, softcap or 0.0,
           M, N, K, K_pad, k_split,
           x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
           scales.stride(0), scales.stride(1), z.stride(0), z.stride(1), *t_strides,
           GROUP=group_size, HAS_ZEROS=zeros is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           GROUP_M=group_m, SPLIT_K=split_k, SPLIT_GRID=split_grid,
           DOT_PREC=dot_precision(x.dtype), HAS_BIAS=bias is not None,
           SOFTCAP=softcap is not None, num_warps=8 if split_k > 1 else 4, num_stages=3)
    if split_grid:
        sum_split_k(target, None, bias, softcap, out)
    return out


# ---- host-side packing (plain torch): tests, and the loaders that repack GPTQ / AWQ ----


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integer codes in [0, 15] -> [N, K // 8] int32, low nibble first along K."""
    check(q.dim() == 2 and q.shape[1] % 8 == 0, f"q must be [N, K] with K % 8 == 0, got {list(q.shape)}")
    shifts = torch.arange(0, 32, 4, device=q.device)  # nibble j at bits 4j .. 4j+3
    words = (q.to(torch.int64).reshape(q.shape[0], -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K // 8] int32 -> q: [N, K] int32 codes in [0, 15]."""
    q = (qweight[:, :, None] >> torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)) & 0xF
    return q.reshape(qweight.shape[0], -1)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                  clip_search: int = 0,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [N, K] float -> (qweight [N, K_pad // 8] int32, scales [N, K_pad // G] fp32,
    zeros [N, K_pad // G] uint8 or None), K_pad = ceil(K / G) * G; round to nearest.

    symmetric: scale = 2 * max|w| / 15 and q = clamp(round(w / s) + 8, 0, 15) (GPTQ's choice: the
    top value max|w| / s = 7.5 clips to 7, still within s / 2). Asymmetric: the group's
    [min(w, 0), max(w, 0)] spans 15 steps, zero = round(-min / s) in [0, 15] (with 0 in the
    range, as GPTQ's quantizer has it, a group of one sign does not clip). A partial last
    group takes its statistics from its real columns; its padding gets the zero-point code.

    clip_search > 0: also try the range shrunk by 1 - i / (clip_search / 0.8) for i <
    clip_search (down to 0.2 of it) and keep, per group, the one with the least squared
    error (GPTQ's ``mse`` option; round-to-nearest otherwise): clipping the rare large weights
    buys a finer step for all the others. Without it, |w - dequantized| <= scale / 2."""
    check(w.dim() == 2 and w.dtype.is_floating_point, "w must be a float [N, K]")
    N, K = w.shape
    check(group_size > 0 and group_size % 16 == 0,
          f"group_size must be a positive multiple of 16 (as int4_matmul needs), got {group_size}")
    groups = cdiv(K, group_size)
    wf = w.float()
    if groups * group_size > K:  # pad with copies of the last column: min, max and max|w| stay
        wf = torch.cat([wf, wf[:, -1:].expand(N, groups * group_size - K)], dim=1)
    wg = wf.view(N, groups, group_size)
    real = (torch.arange(groups * group_size, device=w.device) < K).view(1, groups, group_size)

    def params(shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
        if symmetric:
            s = (wg.abs().amax(-1) * (2 / 15) * shrink).clamp(min=1e-10)
            return s, torch.full_like(s, 8.0)
        lo, hi = wg.amin(-1).clamp(max=0) * shrink, wg.amax(-1).clamp(min=0) * shrink
        s = ((hi - lo) / 15).clamp(min=1e-10)
        return s, torch.round(-lo / s).clamp(0, 15)

    def codes(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)

    scales, zp = params(1.0)
    if clip_search > 0:
        def err(s, z):
            return (((codes(s, z) - z[..., None]) * s[..., None] - wg) ** 2 * real).sum(-1)

        best = err(scales, zp)
        for i in range(1, clip_search):
            s, z = params(1 - 0.8 * i / clip_search)
            e = err(s, z)
            better = e < best
            best = torch.where(better, e, best)
            scales, zp = torch.where(better, s, scales), torch.where(better, z, zp)
    q = codes(scales, zp).reshape(N, -1)
    q[:, K:] = zp[:, -1:]  # padding dequantizes to exactly 0
    return pack_int4(q.to(torch.int32)), scales, None if symmetric else zp.to(torch.uint8)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                    group_size: int = 128, k: int | None = None) -> torch.Tensor:
    """The fp32 W that ``int4_matmul`` multiplies by (reference; loaders, debugging):
    [N, k] given the real K, else [N, K_pad] with the padding."""
    q = unpack_int4(qweight).float()
    z = 8.0 if zeros is None else zeros.float().repeat_interleave(group_size, dim=1)
    return ((q - z) * scales.float().repeat_interleave(group_size, dim=1))[:, :k]
