"""Group-wise quantized linear layers: ``y = x @ W.T``, W dequantized in registers.

    g = k // group_size
    W[n, k] = q[n, k] * scale[n, g] + bias_w[n, g]          fp32, then the dot in x's dtype
    bias_w  = -zero[n, g] * scale[n, g]    zero points (GPTQ / AWQ: integer; symmetric int4: 8)
            = min[n, g]                    or a float minimum (GGUF's Q4_1 / Q5_1 / *_K: d * q + m)
            = 0                            or nothing (int8 codes that are signed values)
    y[m, n] = sum_k x[m, k] * W[n, k]                       fp32 accumulator, y in x's dtype

Two code widths share the kernel (BITS):
    4   qweight [N, K_pad // 8] int32, packed along K, low nibble first:
        word w of row n = | q[n,8w+7] | ... | q[n,8w] |, q in [0, 15]
    8   codes   [N, K_pad] int8 (GGUF's Q8_0, Q5_*, Q6_K: their integer codes fit a byte)
    scales / zeros / mins [N, K_pad // G], any strides (a [K_pad // G, N] tensor's .T works);
    G = group_size, K_pad = ceil(K / G) * G: K in whole groups.

K need not be a multiple of G (stories260k has K = 64 and 172): the last group is partial and
its codes past K are padding, and the kernel masks x past K, so the padding never reaches a sum
whatever it holds (int4_pack.quantize_int4 makes the padded W exactly 0 anyway).

A K tile is either inside one group (the GPU's choice: BLOCK_K divides G, so a tile's scales are
one [BLOCK_N] vector and fold into one FMA per weight), or, on the interpreter, several whole
groups (GGUF's groups of 16 and 32 would otherwise mean 20-40 loop steps a row, and there the
cost is ~ steps x ops): then the tile's [BLOCK_N, BLOCK_K // G] scales are broadcast over their
groups, and the last tile's codes and groups past K_pad are masked. NOTE (ptxas, sm_90, bf16,
64x128x64, zeros): the int4 unpack through tl.interleave keeps a row's 32 consecutive k in one
thread and needs 128 registers; a [BLOCK_N, BLOCK_K / 8, 8] broadcast + reshape got a
1-element-per-thread layout, 254 registers and spills, which is why the GPU keeps one group a
tile. An int4 code becomes a float through the bits of 2^23 + q rather
than an int->float conversion (16 per SM per clock on sm_90 against 128 fp32 adds).
On the interpreter use fp32 or fp16 x: its bf16 tl.dot is wrong (see TRITON_ON_CPU.md).

Cost: 2*M*N*K FLOPs; weight bytes N*K*BITS/8 (+ 2-4 bytes per group for each of scales, zeros or
mins). Tile sizes depend on (N, K, G, dtype), never on M, and split-K follows matmul.py (same
policy, same chunk order): a row's result is the same whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.matmul import check_epilogue, epilogue, split_plan, sum_split_k, tile_offsets
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _codes(q_ptrs, mask, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of codes as fp32 (exact); ``mask`` over the loaded words."""
    if BITS == 4:
        words = tl.load(q_ptrs, mask=mask, other=0)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)  # [BLOCK_N, BLOCK_K]: column k holds word k // 8
        shifts = (tl.arange(0, BLOCK_K) % 8) * 4  # nibble j of a word holds k = 8 * word + j
        # the float 2^23 + q has q in its low mantissa bits: subtracting 2^23 gives q exactly
        nib = ((words >> shifts[None, :]) & 0xF) | 0x4B000000
        return nib.to(tl.float32, bitcast=True) - 8388608.0
    else:
        return tl.load(q_ptrs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _group_params(p_ptr, offs_n, mask_n, g, n_groups, stride_n, stride_g, other,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """A tile's per-group parameter (scale, zero or min) as fp32, broadcastable to the tile:
    [BLOCK_N, 1] when the tile is inside group g, else [BLOCK_N, BLOCK_K] from its groups
    (those past the last, n_groups, masked)."""
    if BLOCK_K <= GROUP:
        return tl.load(p_ptr + offs_n * stride_n + g * stride_g, mask=mask_n,
                       other=other).to(tl.float32)[:, None]
    else:
        PER: tl.constexpr = BLOCK_K // GROUP
        gs = g + tl.arange(0, PER).to(tl.int64)
        p = tl.load(p_ptr + offs_n[:, None] * stride_n + gs[None, :] * stride_g,
                    mask=mask_n[:, None] & (gs < n_groups)[None, :],
                    other=other).to(tl.float32)  # [BLOCK_N, PER]
        p = tl.broadcast_to(p[:, :, None], (BLOCK_N, PER, GROUP))
        return tl.reshape(p, (BLOCK_N, BLOCK_K))


@triton.jit
def _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, k_lo, k_hi,
             stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
             K, GROUP: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """sum_{k_lo <= k < k_hi} x[m, k] * W[n, k] for one tile, fp32, from zero. k_lo is a
    multiple of BLOCK_K, whose tiles lie inside one group (the GPU's: no K mask on the weights,
    the codes hold whole groups) or hold whole groups (the interpreter's: the last may run past
    K_pad, masked). x is masked at its real K (padding: docstring). OFFSET: 0 none, 1 zero
    points (int4 without zeros: 8), 2 float minimums."""
    PER_WORD: tl.constexpr = 8 if BITS == 4 else 1
    offs_k = k_lo + tl.arange(0, BLOCK_K).to(tl.int64)
    offs_w = k_lo // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD).to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :] * stride_qk
    n_groups = (k_hi + GROUP - 1) // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        g = k // GROUP
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] + (k - k_lo) < K), other=0.0)
        if BLOCK_K <= GROUP:
            q_mask = mask_n[:, None]
        else:
            q_mask = mask_n[:, None] & (offs_w[None, :] + (k - k_lo) // PER_WORD
                                        < k_hi // PER_WORD)
        q = _codes(q_ptrs, q_mask, BITS, BLOCK_K)
        s = _group_params(s_ptr, offs_n, mask_n, g, n_groups, stride_sn, stride_sg, 0.0,
                          BLOCK_N, BLOCK_K, GROUP)
        if OFFSET == 2:  # W = q * s + min
            w = q * s + _group_params(z_ptr, offs_n, mask_n, g, n_groups, stride_zn, stride_zg,
                                      0.0, BLOCK_N, BLOCK_K, GROUP)
        elif OFFSET == 1:  # W = (q - z) * s, as q * s + (-z * s): one FMA a weight
            if z_ptr is None:
                z = 8.0
            else:
                z = _group_params(z_ptr, offs_n, mask_n, g, n_groups, stride_zn, stride_zg, 0,
                                  BLOCK_N, BLOCK_K, GROUP)
            w = q * s - z * s
        else:
            w = q * s
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += (BLOCK_K // PER_WORD) * stride_qk
    return acc


@triton.jit
def _group_matmul_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, softcap,
    M, N, K, K_pad, k_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on, stride_os,
    GROUP: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    SPLIT_GRID: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # K: x's columns (the mask); K_pad: the codes', whole groups (the loop bound).
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
                       GROUP, BITS, OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        tl.store(out_ptr + offs_m[:, None] * stride_om + pid_k * stride_os
                 + offs_n[None, :] * stride_on, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        acc = _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n, 0,
                       tl.minimum(K_pad, k_split), stride_xm, stride_xk, stride_qn, stride_qk,
                       stride_sn, stride_sg, stride_zn, stride_zg, K,
                       GROUP, BITS, OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        for c in range(1, SPLIT_K):  # (not unrolled: one chunk's registers at a time)
            acc += _k_chunk(x_ptr, q_ptr, s_ptr, z_ptr, offs_m, offs_n, mask_m, mask_n,
                            c * k_split, tl.minimum(K_pad, (c + 1) * k_split), stride_xm,
                            stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn,
                            stride_zg, K, GROUP, BITS, OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        acc = epilogue(acc, bias_ptr, offs_n, mask_n, softcap, HAS_BIAS, SOFTCAP)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(N: int, K_pad: int, group_size: int, bits: int, dtype: torch.dtype
           ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M). GPU: BLOCK_K divides group_size (a K tile never
    straddles two groups). Interpreter: up to 256 wide, whole groups, dividing K_pad."""
    g_pow2 = group_size & -group_size
    if INTERPRET:  # few, large programs: cost is ~ programs x ops, not FLOPs
        bk = g_pow2
        if group_size == g_pow2:  # whole power-of-two groups: a tile may hold several (the
            bk = max(g_pow2, min(256, next_pow2(K_pad)))  # last one masked past K_pad)
        # (wide tiles: a 49,152-row LM head in 24 programs, not 96; measured 3x faster)
        return 64, min(2048, max(16, next_pow2(N))), bk, 1
    if dtype == torch.float32:  # ieee fp32 runs on FMA units: smaller tiles avoid spills
        return 32, 64, min(32, g_pow2), 8
    # 128-wide K steps as for int8 (a step reads only 64 B of a weight row); no spills at
    # Llama-3-8B shapes (ptxas: 132-212 registers). Not yet timed on a GPU.
    return 64, 128, min(128, g_pow2), 8


def _launch(x, codes, scales, offsets, offset_kind: int, group_size: int, bits: int, K_pad: int,
            out, split_k, split_grid, bias, softcap, tiles) -> torch.Tensor:
    M, K = x.shape
    N = codes.shape[0]
    groups = (N, K_pad // group_size)
    check(scales.shape == groups, f"scales must be [N, K_pad // group_size] = {list(groups)}, "
          f"got {list(scales.shape)}")
    check(scales.dtype in FLOATS, f"scales must be fp16, bf16 or fp32, got {scales.dtype}")
    if offsets is not None:
        check(offsets.shape == groups, f"zeros / mins must be [N, K_pad // group_size] = "
              f"{list(groups)}, got {list(offsets.shape)}")
        check(offsets.dtype != torch.bool and not offsets.is_complex(),
              f"bad zeros / mins dtype {offsets.dtype}")
    check(all(t.device == x.device for t in (codes, scales, offsets) if t is not None),
          "x, the codes, scales and zeros / mins must be on the same device")
    check_epilogue(bias, softcap, N, x.device)
    if out is None:
        out = empty((M, N), x.dtype, x.device)
    check(out.shape == (M, N) and out.dtype.is_floating_point, f"out must be a float [{M}, {N}]")
    if M == 0:
        return out
    bm, bn, bk, group_m = tiles or _tiles(N, K_pad, group_size, bits, x.dtype)
    check(bk % group_size == 0 or group_size % bk == 0, "a K tile must hold whole groups or "
          "lie inside one")
    tiles, split_k, split_grid, k_split = split_plan(M, N, K_pad, bm, bn, bk, x.device, split_k,
                                                     split_grid)
    grid = tiles if group_m == 1 else (tiles[0] * tiles[1],)
    target, t_strides = out, (out.stride(0), out.stride(1), 0)
    if split_grid:  # [M, split, N] fp32 partial sums, as in matmul.py
        grid += (split_k,)
        target = empty((M, split_k, N), torch.float32, x.device)
        t_strides = (target.stride(0), target.stride(2), target.stride(1))
    z = scales if offsets is None else offsets  # (never read without them)
    launch(_group_matmul_kernel, grid,
           x, codes, scales, None if offset_kind == 1 and offsets is None else z,
           scales if bias is None else bias, target, softcap or 0.0,
           M, N, K, K_pad, k_split,
           x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
           scales.stride(0), scales.stride(1), z.stride(0), z.stride(1), *t_strides,
           GROUP=group_size, BITS=bits, OFFSET=offset_kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           GROUP_M=group_m, SPLIT_K=split_k, SPLIT_GRID=split_grid,
           DOT_PREC=dot_precision(x.dtype), HAS_BIAS=bias is not None,
           SOFTCAP=softcap is not None, num_warps=8 if split_k > 1 else 4, num_stages=3)
    if split_grid:
        sum_split_k(target, None, bias, softcap, out)
    return out


def _check_x(x: torch.Tensor, codes: torch.Tensor) -> None:
    check(x.dim() == 2 and codes.dim() == 2, "x must be [M, K] and the codes 2-D")
    check(x.dtype in FLOATS, f"x must be fp16, bf16 or fp32, got {x.dtype}")


def _check_k(K: int, K_pad: int, group_size: int, what: str) -> None:
    check(group_size > 0 and group_size % 16 == 0,
          f"group_size must be a positive multiple of 16 (the smallest K tile), got {group_size}")
    check(K_pad % group_size == 0, f"{what} holds {K_pad} codes a row: not whole groups of "
          f"group_size={group_size}")
    check(cdiv(K, group_size) * group_size == K_pad,
          f"inner sizes differ: x has {K} columns, {what} {K_pad} codes a row (K rounded up to "
          f"a multiple of group_size={group_size})")


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None = None, group_size: int = 128, *,
                mins: torch.Tensor | None = None, out: torch.Tensor | None = None,
                split_k: int | None = None, split_grid: bool | None = None,
                bias: torch.Tensor | None = None, softcap: float | None = None,
                tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] float, qweight: [N, K_pad // 8] int32, scales and zeros or mins:
    [N, K_pad // group_size] with K_pad = ceil(K / group_size) * group_size -> out: [M, N] = x @
    W.T, W = (q - zero) * scale (no zeros: 8) or q * scale + min (module docstring), + bias [N]
    and soft-capped as ``matmul`` does. ``split_k`` and ``split_grid`` as in ``matmul``: chosen
    per (N, K) by default, never by M; ``tiles``: force (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)."""
    _check_x(x, qweight)
    check(qweight.dtype == torch.int32, f"qweight must be int32 (8 nibbles a word), got {qweight.dtype}")
    check(zeros is None or mins is None, "give zeros or mins, not both")
    K_pad = qweight.shape[1] * 8
    _check_k(x.shape[1], K_pad, group_size, "qweight")
    return _launch(x, qweight, scales, mins if mins is not None else zeros,
                   2 if mins is not None else 1, group_size, 4, K_pad, out, split_k,
                   split_grid, bias, softcap, tiles)


def int8_group_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      group_size: int, *, mins: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, split_k: int | None = None,
                      split_grid: bool | None = None, bias: torch.Tensor | None = None,
                      softcap: float | None = None,
                      tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] float, codes: [N, K_pad] int8, scales (and mins): [N, K_pad // group_size] ->
    out: [M, N] = x @ W.T with W = codes * scale (+ min): GGUF's 5-, 6- and 8-bit formats, whose
    codes fit a byte (module docstring); the rest as ``int4_matmul``."""
    _check_x(x, codes)
    check(codes.dtype == torch.int8, f"codes must be int8, got {codes.dtype}")
    K_pad = codes.shape[1]
    _check_k(x.shape[1], K_pad, group_size, "codes")
    return _launch(x, codes, scales, mins, 2 if mins is not None else 0, group_size, 8, K_pad,
                   out, split_k, split_grid, bias, softcap, tiles)
