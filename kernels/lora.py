"""Multi-LoRA over a ragged batch (punica's BGMV / SGMV): each token row has its own adapter.

    shrink:  y[t, :]        = x[t] @ A[slot[t]].T                       (slot -1: y[t] = 0)
    expand:  out[t, o:o+N] += scale[slot[t]] * (y[t, j:j+r] @ B[slot[t]].T)   (slot -1: untouched)

The base projection runs separately (any weight format: float, int8, int4); these kernels
only touch x, y and out. Layouts:

    x       [T, K]        fp32 / fp16 / bf16, unit column stride (the projection's input)
    lora_a  [S, R, K]     x's dtype: the resident adapters' A by slot, rank padded with zero
                          rows; several modules' A may be stacked along R (q | k | v of a fused
                          projection: R = 3 * r_max) so that one shrink serves every slice
    slots   [T]           int32 adapter slot per row; -1 (or anything outside [0, S)): none
    y       [T, R]        fp32, from shrink
    lora_b  [S, N, r]     any float dtype: one slice's B, rank padded with zero columns
    scales  [S]           fp32: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)) per slot
    out     [T, N_total]  the model dtype; slice columns [o, o + N), y columns [j, j + r)

Design. A program owns a fixed tile of BLOCK_M consecutive rows and walks the distinct slots
among them (smallest first): for each slot s, one tl.dot over the whole tile with s's matrix,
the x / y rows of other slots masked out of the loads, and the tile's result taken for s's rows
only (``tl.where``). So a prefill chunk (many consecutive rows, one adapter) is one dot per K
step, and a decode tile of rows with different adapters is one dot per distinct adapter: the
gather BGMV does per row, by whole tiles. Rows without an adapter cost nothing: a tile with no
adapter rows runs no dot (its only traffic is BLOCK_M slots, and for shrink the zeros it
stores), so the launches can stay in every recorded decode step and CUDA graph, where the
slots and adapter weights are whatever the static buffers hold at replay. NOTE (interpreter,
16 rows, best of 30): an all-base shrink / expand costs 2.5 / 1.4 ms, 6.3 / 6.2 with one
adapter. Each adapter row's y and out are written in its slot's pass, once (no accumulator
across slots: fewer registers, and nothing to set up before the walk). GPU tiles: 16 rows
(tl.dot's minimum, so a decode tile walks at most 16 adapters); shrink 128-wide K steps, split
K as matmul.py's for decode (R is a single tile of <= 64 columns, so without it a 16-row step
would be one program); expand 128 columns x the rank in steps of 16. On the interpreter: up to
64 rows, the whole R / N (to 256 / 1024) and K (to 512) per program, the fewest programs.

Exactness. A row's numbers depend only on its own x / y row, its slot's matrices and the
shape: GPU tiles depend on (R, K) or (N, r) and the dtype, never on T (the interpreter's grow
with T, which is as invariant: its tl.dot is row-stable, kernels/interpreter.py); each slot's
sum starts from zero in a fixed K order and is selected, never added to other slots' results;
split-K follows matmul.py (chunks by (R, K) alone, summed in order, in one program or in
separate ones: the same fp32 operations). So a row is bit-identical alone and in any mix.
Expand never loads or stores a base row (slot -1): its bits are exactly the base model's, no
``+ 0.0`` round trip (which would turn -0.0 into +0.0 and may quiet a NaN). Its sum is fp32: y
stays fp32 (punica / vLLM round it to the model dtype first), B is widened, and with 16-bit
outputs the dot is "tf32x3" (tensor cores, ~fp32 accurate; fp16 / bf16 B are exact in tf32),
with fp32 outputs "ieee"; scaled, added to out in fp32 and rounded once. Shrink dots in x's
dtype with an fp32 accumulator (fp32 x: "ieee").

Bytes (e = bytes per model-dtype element, T_a = rows with an adapter, d(tile) = distinct
slots in a row tile):
    shrink: x T_a*K*e per R tile (base rows are never loaded), A sum_tiles d(tile)*R*K*e,
            y T*R*4 (split-K partials add 2*T*split*R*4)
    expand: y T_a*r*4 per N tile, B sum_tiles d(tile)*N*r*e, out 2*T_a*N*e (read, write)
Llama-3-8B, bf16, r = 16: per adapter in a tile, the qkv projection moves 384 KiB of A
(R = 48 x 4096) and 192 KiB of B (6144 x 16), against 48 MiB of base weights (1.2%). A prefill
chunk reads its adapter's A / B once per 16-row tile, from L2 (the x tile of 16 x 4096 is as
large as A), HBM about once. A decode tile reads each distinct adapter's matrices once: worst
case (all rows different) that is per row, as BGMV's gather; fewer when the batcher orders
decode rows by slot (results do not change: invariant). Alternatives left out: sorting rows by
adapter on the device (vLLM's punica kernels) needs a per-step sort and permuted metadata; an
atomic split-K sum is not bit-reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.matmul import split_plan, sum_split_k
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _next_slot(slot, pending, S):
    """The smallest slot among the pending rows of a tile; S when none is left."""
    return tl.min(tl.where(pending, slot, S), axis=0)


@triton.jit
def _shrink_chunk(x_rows, a_ptr, a_off, rows, mask_r, k_lo, k_hi,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """sum_{k_lo <= k < k_hi} x[m, k] * a[r, k] for the tile's ``rows`` (others 0), fp32, from
    zero. x_rows [BLOCK_M, 1]: the rows' pointers; a_ptr: the slot's [R, K] matrix, a_off
    [BLOCK_K, BLOCK_R] int32 offsets in it (the launcher checks that they fit; NOTE: int64
    pointer tiles carried through the loop cost 2 registers an element, and spilled at
    BLOCK_R 64); k_lo is a multiple of BLOCK_K."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        mask_k = (k + offs_k) < k_hi
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=rows[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + k + a_off, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, y_ptr,
    T, R, K, S, k_split,
    stride_xm, stride_as, stride_ar, stride_ym, stride_yr, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_GRID: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_m = offs_m < T
    mask_r = offs_r < R
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1)
    pending = mask_m & (slot >= 0) & (slot < S)
    if SPLIT_GRID:  # this program's K chunk; _split_k_sum_kernel adds the chunks in order
        pid_k = tl.program_id(2)
    else:
        pid_k = 0
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + pid_k * stride_ys + offs_r[None, :] * stride_yr
    tl.store(y_ptrs, tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32),
             mask=(mask_m & ~pending)[:, None] & mask_r[None, :])  # base rows: zeros
    s = _next_slot(slot, pending, S)
    while s < S:  # once per distinct slot in the tile; not at all for a tile of base rows
        rows = pending & (slot == s)
        # (set up here, not before the walk: a tile of base rows skips it)
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        a_off = offs_r[None, :] * stride_ar + tl.arange(0, BLOCK_K)[:, None]  # [BLOCK_K, BLOCK_R]
        a_s = a_ptr + s.to(tl.int64) * stride_as
        if SPLIT_GRID:
            k_lo = pid_k * k_split
            acc = _shrink_chunk(x_rows, a_s, a_off, rows, mask_r, k_lo,
                                tl.minimum(K, k_lo + k_split), BLOCK_M, BLOCK_R, BLOCK_K, DOT_PREC)
        else:  # the same chunks, each from zero, added in order (as matmul.py's)
            acc = _shrink_chunk(x_rows, a_s, a_off, rows, mask_r, 0, tl.minimum(K, k_split),
                                BLOCK_M, BLOCK_R, BLOCK_K, DOT_PREC)
            for c in range(1, SPLIT_K):
                acc += _shrink_chunk(x_rows, a_s, a_off, rows, mask_r, c * k_split,
                                     tl.minimum(K, (c + 1) * k_split), BLOCK_M, BLOCK_R,
                                     BLOCK_K, DOT_PREC)
        tl.store(y_ptrs, acc, mask=rows[:, None] & mask_r[None, :])  # s's rows only
        pending = pending & (slot != s)
        s = _next_slot(slot, pending, S)


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, slot_ptr, scale_ptr, out_ptr,
    T, N, r, S,
    stride_ym, stride_bs, stride_bn, stride_br, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < T
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1)
    pending = mask_m & (slot >= 0) & (slot < S)
    s = _next_slot(slot, pending, S)
    while s < S:  # once per distinct slot in the tile; not at all for a tile of base rows
        rows = pending & (slot == s)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, BLOCK_R)
        mask_n = offs_n < N
        y_rows = y_ptr + offs_m[:, None] * stride_ym
        b_s = b_ptr + s.to(tl.int64) * stride_bs
        b_off = offs_j[:, None] * stride_br + offs_n[None, :] * stride_bn  # [BLOCK_R, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(0, r, BLOCK_R):
            mask_j = (j + offs_j) < r
            yv = tl.load(y_rows + (j + offs_j)[None, :], mask=rows[:, None] & mask_j[None, :],
                         other=0.0)
            b = tl.load(b_s + j * stride_br + b_off, mask=mask_j[:, None] & mask_n[None, :],
                        other=0.0)
            acc = tl.dot(yv, b.to(tl.float32), acc, input_precision=DOT_PREC)
        # s's rows of out, each read and written once; base rows never: the base model's bits
        mask = rows[:, None] & mask_n[None, :]
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (o + acc * tl.load(scale_ptr + s)).to(out_ptr.dtype.element_ty),
                 mask=mask)
        pending = pending & (slot != s)
        s = _next_slot(slot, pending, S)


def _check_slots(slots: torch.Tensor, T: int, device: torch.device) -> None:
    check(slots.shape == (T,) and slots.dtype == torch.int32 and slots.stride(0) == 1,
          f"slots must be a contiguous int32 [{T}]")
    check(slots.device == device, "slots must be on the activations' device")


def _shrink_tiles(T: int, R: int, K: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, num_warps). GPU: 16-row tiles (tl.dot's minimum; a decode
    tile walks at most 16 adapters) whatever T; fp32 ("ieee", FMA units) smaller. NOTE
    (ptxas, sm_90, bf16): BLOCK_R 64 takes 102 registers with 4 warps, 77-88 with 8 (and more
    loads in flight); with int64 pointer tiles 4 warps spilled. Both split modes get the same
    warps, so they run the same MMA shapes and give the same bits."""
    if INTERPRET:  # few, large programs: cost is ~ programs x ops, not FLOPs
        return (min(64, next_pow2(T)), min(256, max(16, next_pow2(R))),
                min(512, max(16, next_pow2(K))), 4)
    if dtype == torch.float32:
        return 16, min(32, max(16, next_pow2(R))), 32, 4
    block_r = min(64, max(16, next_pow2(R)))
    return 16, block_r, 128, 8 if block_r >= 32 else 4


def _expand_tiles(T: int, N: int, r: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R). GPU: the rank in steps of 16. NOTE (ptxas, sm_90, bf16
    out, tf32x3, 4 warps): BLOCK_R 16 takes 95 registers, 32: 168, 64: 255 and spills."""
    if INTERPRET:
        return (min(64, next_pow2(T)), min(1024, max(16, next_pow2(N))),
                min(256, max(16, next_pow2(r))))
    return 16, 64 if dtype == torch.float32 else 128, 16


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                out: torch.Tensor | None = None, split_k: int | None = None,
                split_grid: bool | None = None) -> torch.Tensor:
    """x: [T, K], lora_a: [S, R, K] (x's dtype), slots: [T] int32 -> y: [T, R] fp32 with
    y[t] = x[t] @ lora_a[slots[t]].T, and zeros (stored by the kernel) where slots[t] is -1 or
    outside [0, S). ``split_k`` / ``split_grid`` as ``matmul``'s (default: by (R, K) on a GPU,
    none on the CPU); every choice gives the same bits."""
    check(x.dim() == 2 and x.stride(1) == 1, "x must be [T, K] with unit column stride")
    check(x.dtype in FLOATS, f"x must be fp32, fp16 or bf16, got {x.dtype}")
    check(lora_a.dim() == 3 and lora_a.stride(2) == 1,
          "lora_a must be [S, R, K] with unit stride along K")
    T, K = x.shape
    S, R, _ = lora_a.shape
    check(lora_a.shape[2] == K, f"inner sizes differ: x is [{T}, {K}], lora_a is {list(lora_a.shape)}")
    check(S >= 1 and R >= 1, "lora_a needs at least one slot and one rank row")
    check(lora_a.dtype == x.dtype, f"lora_a must be x's dtype {x.dtype}, got {lora_a.dtype}")
    check(lora_a.device == x.device, "x and lora_a must be on the same device")
    check((R - 1) * lora_a.stride(1) + K < 2**31, "one adapter's A must span < 2^31 elements")
    _check_slots(slots, T, x.device)
    if out is None:
        out = empty((T, R), torch.float32, x.device)
    check(out.shape == (T, R) and out.dtype == torch.float32 and out.device == x.device,
          f"out must be fp32 [{T}, {R}] on x's device")
    if T == 0:
        return out
    bm, br, bk, warps = _shrink_tiles(T, R, K, x.dtype)
    tiles, split_k, split_grid, k_split = split_plan(T, R, K, bm, br, bk, x.device, split_k,
                                                     split_grid)
    grid, target, t_strides = tiles, out, (out.stride(0), out.stride(1), 0)
    if split_grid:  # [T, split, R] fp32 partial sums (T first: scratch pools key on rows)
        grid += (split_k,)
        target = empty((T, split_k, R), torch.float32, x.device)
        t_strides = (target.stride(0), target.stride(2), target.stride(1))
    launch(_lora_shrink_kernel, grid, x, lora_a, slots, target, T, R, K, S, k_split,
           x.stride(0), lora_a.stride(0), lora_a.stride(1), *t_strides,
           BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, SPLIT_K=split_k, SPLIT_GRID=split_grid,
           DOT_PREC=dot_precision(x.dtype), num_warps=warps)
    if split_grid:
        sum_split_k(target, None, None, None, out)
    return out


def lora_expand(y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                scales: torch.Tensor, out: torch.Tensor, y_offset: int = 0,
                out_offset: int = 0) -> None:
    """y: [T, R_total] fp32, lora_b: [S, N, r], slots: [T] int32, scales: [S] fp32,
    out: [T, N_total] (in place):
    out[t, out_offset:out_offset + N] += scales[s] * (y[t, y_offset:y_offset + r] @ lora_b[s].T)
    with s = slots[t], summed in fp32 and rounded once; rows whose slot is -1 (or outside
    [0, S)) are never read or written."""
    check(y.dim() == 2 and y.dtype == torch.float32 and y.stride(1) == 1,
          "y must be fp32 [T, R_total] with unit column stride")
    check(lora_b.dim() == 3 and lora_b.dtype in FLOATS, "lora_b must be a float [S, N, r]")
    check(out.dim() == 2 and out.dtype in FLOATS, "out must be a float [T, N_total]")
    T = y.shape[0]
    S, N, r = lora_b.shape
    check(S >= 1 and N >= 1 and r >= 1, f"lora_b must be non-empty, got {list(lora_b.shape)}")
    check(out.shape[0] == T, f"out must have y's {T} rows, got {out.shape[0]}")
    check(0 <= y_offset and y_offset + r <= y.shape[1],
          f"y columns [{y_offset}, {y_offset + r}) outside y's {y.shape[1]}")
    check(0 <= out_offset and out_offset + N <= out.shape[1],
          f"out columns [{out_offset}, {out_offset + N}) outside out's {out.shape[1]}")
    check(scales.shape == (S,) and scales.dtype == torch.float32 and scales.stride(0) == 1,
          f"scales must be a contiguous fp32 [{S}]")
    check((r - 1) * lora_b.stride(2) + (N - 1) * lora_b.stride(1) < 2**31,
          "one adapter's B must span < 2^31 elements")
    for name, t in (("lora_b", lora_b), ("scales", scales), ("out", out)):
        check(t.device == y.device, f"{name} must be on y's device")
    _check_slots(slots, T, y.device)
    if T == 0:
        return
    bm, bn, br = _expand_tiles(T, N, r, out.dtype)
    launch(_lora_expand_kernel, (cdiv(T, bm), cdiv(N, bn)), y[:, y_offset:], lora_b, slots,
           scales, out[:, out_offset:], T, N, r, S, y.stride(0), lora_b.stride(0),
           lora_b.stride(1), lora_b.stride(2), out.stride(0), out.stride(1),
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br,
           DOT_PREC="ieee" if out.dtype == torch.float32 else "tf32x3", num_warps=4)
