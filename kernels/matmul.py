"""Linear layers: ``out = a @ w.T`` with w in the Hugging Face [out_features, in_features] layout.

Two weight formats share one kernel:
- float (fp32/fp16/bf16): a plain tiled matmul with an fp32 accumulator;
- int8 weight-only: w_q int8 [N, K] with per-output-channel scales [N] (symmetric,
  w ~= w_q * scale[:, None]). Each weight tile is converted to the activation dtype in
  registers and the scale is applied once to the accumulator, since it factors out of the
  K-sum:  out[m, n] = scale[n] * sum_k a[m, k] * w_q[n, k].  The fp weight never exists in
  memory, so decode (memory-bound on weight bytes) reads half (vs fp16) or a quarter (vs fp32).

The epilogue, on the fp32 accumulator before the one rounding to the output dtype, adds an
optional bias [N] (Qwen2's q/k/v projections) and soft-caps (Gemma 2's final logits:
``cap * tanh(y / cap)``), so neither costs a pass over the output.

Cost: 2*M*N*K FLOPs; bytes ~ M*K*a + N*K*w (+ 4N scales) + M*N*out.
Tile sizes depend on (N, K) only, never on M: a row's result is the same whatever the batch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyserve.kernels.jitmath import softcap as cap_logits
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2


@triton.jit
def _k_chunk(a_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_lo, k_hi,
             stride_am, stride_ak, stride_wn, stride_wk,
             W_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """sum_{k_lo <= k < k_hi} a[m, k] * w[n, k] for one tile, fp32, from zero."""
    offs_k = k_lo + tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_hi - k_lo, BLOCK_K):
        mask_k = (offs_k + k) < k_hi
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        if W_INT8:
            w = w.to(a.dtype)  # exact: |w_q| <= 127
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def epilogue(acc, bias_ptr, offs_n, mask_n, softcap, HAS_BIAS: tl.constexpr,
             SOFTCAP: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 (scaled) -> + bias[n], then cap * tanh(acc / cap)."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        acc = cap_logits(acc, softcap)
    return acc


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile: (offs_m, offs_n, mask_m, mask_n). GROUP_M > 1: grouped
    order, GROUP_M row tiles sweep the same weight columns while they sit in L2 (the grid is
    then one axis of tiles)."""
    if GROUP_M == 1:
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
    else:
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group_id = pid // (GROUP_M * num_pid_n)
        first_m = group_id * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = (first_m + (pid % (GROUP_M * num_pid_n)) % group_size).to(tl.int64)
        pid_n = ((pid % (GROUP_M * num_pid_n)) // group_size).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    return offs_m, offs_n, mask_m, mask_n


@triton.jit
def _matmul_kernel(
    a_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_split, softcap,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_os,
    W_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_GRID: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # K is summed in SPLIT_K chunks of k_split, each from zero, the chunk sums added in order:
    # the same fp32 operations whether the chunks run in separate programs (SPLIT_GRID, for
    # few tiles: decode; each stores its partial and _split_k_sum_kernel adds them) or one
    # after another in this program (many tiles: prefill). A row's result never depends on
    # which, nor on M.
    if SPLIT_GRID:
        pid_k = tl.program_id(2 if GROUP_M == 1 else 1).to(tl.int64)
        k_lo = pid_k * k_split
        acc = _k_chunk(a_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_lo,
                       tl.minimum(K, k_lo + k_split), stride_am, stride_ak, stride_wn, stride_wk,
                       W_INT8, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        tl.store(out_ptr + offs_m[:, None] * stride_om + pid_k * stride_os
                 + offs_n[None, :] * stride_on, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        acc = _k_chunk(a_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, 0, tl.minimum(K, k_split),
                       stride_am, stride_ak, stride_wn, stride_wk,
                       W_INT8, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        for c in range(1, SPLIT_K):  # (not unrolled: one chunk's registers at a time)
            acc += _k_chunk(a_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, c * k_split,
                            tl.minimum(K, (c + 1) * k_split), stride_am, stride_ak, stride_wn,
                            stride_wk, W_INT8, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
        if W_INT8:
            acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = epilogue(acc, bias_ptr, offs_n, mask_n, softcap, HAS_BIAS, SOFTCAP)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_k_sum_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N, softcap, stride_pm,
                        stride_ps, stride_om, stride_on, W_INT8: tl.constexpr,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    ptrs = part_ptr + offs_m[:, None] * stride_pm + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # fixed order: the same sum whatever the batch
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    if W_INT8:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = epilogue(acc, bias_ptr, offs_n, mask_n, softcap, HAS_BIAS, SOFTCAP)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_epilogue(bias: torch.Tensor | None, softcap: float | None, N: int,
                   device: torch.device) -> None:
    if bias is not None:
        check(bias.shape == (N,) and bias.stride(0) == 1 and bias.device == device
              and bias.dtype.is_floating_point, f"bias must be a contiguous float [{N}]")
    check(softcap is None or softcap > 0, f"softcap must be > 0, got {softcap}")


def sum_split_k(partials: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                softcap: float | None, out: torch.Tensor) -> None:
    """The split-K partials [M, split_k, N] fp32, summed in order, scaled, epilogue, into out."""
    M, split_k, N = partials.shape
    block_m = min(64, next_pow2(M)) if INTERPRET else 16
    block_n = min(1024 if INTERPRET else 128, next_pow2(N))
    launch(_split_k_sum_kernel, (cdiv(M, block_m), cdiv(N, block_n)),
           partials, partials if scale is None else scale,
           partials if bias is None else bias, out, M, N, softcap or 0.0,
           partials.stride(0), partials.stride(1), out.stride(0), out.stride(1),
           W_INT8=scale is not None, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n,
           HAS_BIAS=bias is not None, SOFTCAP=softcap is not None)


def _tiles(N: int, K: int, dtype: torch.dtype, w_int8: bool) -> tuple[int, int, int, int]:
    if INTERPRET:  # few, large programs: cost is ~ programs x ops, not FLOPs
        return 64, min(2048, max(16, next_pow2(N))), min(256, max(16, next_pow2(K))), 1
    if dtype == torch.float32:  # ieee fp32 runs on FMA units: smaller tiles avoid spills
        return 32, 64, 32, 8
    # int8 weights: half the bytes per K step, so twice the K per tile for the same load size
    return 64, 128, 128 if w_int8 else 64, 8


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(M: int, N: int, K: int, bm: int, bn: int, bk: int, device: torch.device,
               split_k: int | None, split_grid: bool | None
               ) -> tuple[tuple[int, int], int, bool, int]:
    """(output tiles, split_k, split_grid, k_split) for a launch: split-K by split_k_for unless
    given; chunks as separate programs only while the tiles leave SMs idle; whole K tiles per
    chunk (so a K tile never straddles chunks, nor, for int4, groups)."""
    tiles = cdiv(M, bm), cdiv(N, bn)
    if split_k is None:
        split_k = 1 if INTERPRET else split_k_for(N, K, bn, bk, _sm_count(device.index or 0))
    check(split_k >= 1, "split_k must be >= 1")
    if split_grid is None:
        split_grid = split_k > 1 and (
            INTERPRET or tiles[0] * tiles[1] < _sm_count(device.index or 0))
    return tiles, split_k, split_grid, cdiv(cdiv(K, split_k), bk) * bk


def split_k_for(N: int, K: int, bn: int, bk: int, num_sms: int) -> int:
    """Split K so that a layer with few column tiles still fills the SMs at decode batch sizes
    (N=4096: 32 tiles of 128 on 132 SMs -> 4 splits), keeping >= 4 K tiles per split. Chosen by
    (N, K) alone, never M: a row's sum is the same in every batch (batch invariance)."""
    tiles, split = cdiv(N, bn), 1
    while tiles * split * 2 <= num_sms and K // (split * 2) >= 4 * bk:
        split *= 2
    return split


def _launch(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
            out: torch.Tensor | None, split_k: int | None = None,
            split_grid: bool | None = None, bias: torch.Tensor | None = None,
            softcap: float | None = None) -> torch.Tensor:
    check(a.dim() == 2 and w.dim() == 2, "a must be [M, K] and w [N, K]")
    M, K = a.shape
    N = w.shape[0]
    check(w.shape[1] == K, f"inner sizes differ: a is [{M}, {K}], w is {list(w.shape)}")
    check(a.device == w.device, "a and w must be on the same device")
    check_epilogue(bias, softcap, N, a.device)
    if out is None:
        out = empty((M, N), a.dtype, a.device)
    check(out.shape == (M, N), f"out must be [{M}, {N}]")
    if M == 0:
        return out
    w_int8 = scale is not None
    bm, bn, bk, group_m = _tiles(N, K, a.dtype, w_int8)
    tiles, split_k, split_grid, k_split = split_plan(M, N, K, bm, bn, bk, a.device, split_k,
                                                     split_grid)
    grid = tiles if group_m == 1 else (tiles[0] * tiles[1],)
    target, t_strides = out, (out.stride(0), out.stride(1), 0)
    if split_grid:  # [M, split, N] fp32 partial sums (M first: scratch pools key on rows)
        grid += (split_k,)
        target = empty((M, split_k, N), torch.float32, a.device)
        t_strides = (target.stride(0), target.stride(2), target.stride(1))
    launch(_matmul_kernel, grid,
        a, w, scale if w_int8 else w, w if bias is None else bias, target, M, N, K, k_split,
        softcap or 0.0, a.stride(0), a.stride(1), w.stride(0), w.stride(1), *t_strides,
        W_INT8=w_int8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, SPLIT_K=split_k,
        SPLIT_GRID=split_grid, DOT_PREC=dot_precision(a.dtype), HAS_BIAS=bias is not None,
        SOFTCAP=softcap is not None,
        # chunks in one program hold two accumulators: 8 warps keep them in registers; the
        # same 8 when they are separate programs, so both run the same MMA shapes (bit-equal)
        num_warps=8 if split_k > 1 else 4, num_stages=3)
    if split_grid:
        sum_split_k(target, scale, bias, softcap, out)
    return out


def matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
           split_k: int | None = None, split_grid: bool | None = None,
           bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """a: [M, K], w: [N, K] (same float dtype) -> out: [M, N] = a @ w.T (+ bias [N]; then
    ``softcap * tanh(out / softcap)`` when given).

    ``split_k``: K chunks (default: chosen per (N, K) on a GPU, 1 on the CPU); ``split_grid``:
    the chunks in separate programs (default: on the CPU, or while tiles leave SMs idle) or
    one after another in each program - the same numbers either way."""
    check(a.dtype == w.dtype and a.dtype.is_floating_point, "a and w must share a float dtype")
    return _launch(a, w, None, out, split_k, split_grid, bias, softcap)


def int8_matmul(a: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                out: torch.Tensor | None = None, split_k: int | None = None,
                split_grid: bool | None = None, bias: torch.Tensor | None = None,
                softcap: float | None = None) -> torch.Tensor:
    """a: [M, K] float, w_q: [N, K] int8, scale: [N] fp32 -> out: [M, N] = a @ (w_q * scale).T
    (+ bias, soft-cap as in ``matmul``)."""
    check(w_q.dtype == torch.int8, f"w_q must be int8, got {w_q.dtype}")
    check(a.dtype.is_floating_point, "a must be a float tensor")
    check(scale.shape == (w_q.shape[0],), "scale must be [N] (one per output channel)")
    return _launch(a, w_q, scale, out, split_k, split_grid, bias, softcap)
