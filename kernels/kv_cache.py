"""KV-cache write through a slot mapping, and the block-table update of a persistent table.

    k_cache.view(-1, Hk * Dh)[slot[t]] = k[t]      (and the same for v)

A slot is ``block_id * block_size + offset_in_block``; slot -1 means "do not write" (padding).
Layouts: k, v [T, Hk, Dh] with (Hk, Dh) contiguous per token (strided views of the fused qkv
projection are fine); k_cache, v_cache [num_blocks, block_size, Hk, Dh] contiguous; slots [T].

int8 caches (``--kv-cache-dtype int8``) add k_scale, v_scale [num_blocks, block_size, Hk] fp16,
one scale per token and KV head, symmetric:

    s = fp16(max_d |x[t, h, d]| / 127)      code[t, h, d] = clamp(round(x / s), -127, 127)
    x ~= code * s                           (|error| <= s / 2, plus s's own fp16 rounding)

Per token because a token's K/V is written once and never rewritten: its scale is final when
written, so no block ever needs requantizing (a per-block scale would, as tokens arrive). The
code is computed against the fp16-rounded scale, so what attention multiplies back is exactly
the scale the code was made with. fp16 scales: 2 bytes per token and head, so a head_dim-128
token costs 130 bytes against fp16's 256 (0.51x); at head_dim 8 (stories260k) 10 against 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch, next_pow2


@triton.jit
def finite_or_zero(x, DTYPE: tl.constexpr):
    """x as the cache holds it (DTYPE), with NaN and +-inf (an overflowing sequence's K/V) as
    0: a decode program shares its key tile among sequences and gives other sequences' V rows
    exact zero weights, and 0 * inf is NaN - one poisoned sequence would reach all of them.
    Returned in fp32, exact for DTYPE's values."""
    y = x.to(DTYPE).to(tl.float32)
    return tl.where(tl.abs(y) < float("inf"), y, 0.0)


@triton.jit
def quantize_kv(x1, x2, x3, HAS_REST: tl.constexpr = False):
    """Parts [BLOCK_T, BLOCK_H, *] of each (token, head) vector (two halves, and with HAS_REST
    a third: the dims past a partial rotary) -> their int8 codes and the fp16 scale
    [BLOCK_T, BLOCK_H] (as fp16). Padding lanes must hold 0 (they do not raise the max). An
    all-zero vector gets scale 0 and codes 0. Without HAS_REST, x3 is ignored (c3 is c1)."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=2), tl.max(tl.abs(x2), axis=2))
    if HAS_REST:
        amax = tl.maximum(amax, tl.max(tl.abs(x3), axis=2))
    # (capped at fp16's largest: a vector beyond 127 * 65504 clips instead of becoming NaN)
    scale = tl.minimum(amax / 127.0, 65504.0).to(tl.float16)
    s = scale.to(tl.float32)
    inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)[:, :, None]
    c1 = _round_clamp(x1 * inv)
    c2 = _round_clamp(x2 * inv)
    if HAS_REST:
        c3 = _round_clamp(x3 * inv)
    else:
        c3 = c1
    return c1, c2, c3, scale


@triton.jit
def _round_clamp(x):
    # round half away from zero (the float -> int conversion truncates), then the int8 range
    r = (x + tl.where(x >= 0.0, 0.5, -0.5)).to(tl.int32)
    return tl.minimum(tl.maximum(r, -127), 127).to(tl.int8)


@triton.jit
def _write_kv_int8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_vt, T, num_kv_heads, head_dim, num_slots,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Tiles are [tokens, heads, half a head]: the two halves of a head are one program's, so
    # its max is computed in registers (the same split as the fused rotary kernel's).
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    half = head_dim // 2
    mask_t = offs_t < T
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    th_ok = (mask_t & (slot >= 0) & (slot < num_slots))[:, None] & (offs_h < num_kv_heads)[None, :]
    mask = th_ok[:, :, None] & (offs_d < half)[None, None, :]
    src = offs_h[None, :, None] * head_dim + offs_d[None, None, :]
    dst = slot[:, None, None] * (num_kv_heads * head_dim) + src
    s_dst = slot[:, None] * num_kv_heads + offs_h[None, :]
    _quantize_into(k_ptr + offs_t[:, None, None] * stride_kt + src, k_cache_ptr + dst,
                   k_scale_ptr + s_dst, mask, th_ok, half)
    _quantize_into(v_ptr + offs_t[:, None, None] * stride_vt + src, v_cache_ptr + dst,
                   v_scale_ptr + s_dst, mask, th_ok, half)


@triton.jit
def _quantize_into(x_ptrs, code_ptrs, scale_ptrs, mask, th_ok, half):
    x1 = finite_or_zero(tl.load(x_ptrs, mask=mask, other=0.0), tl.float32)
    x2 = finite_or_zero(tl.load(x_ptrs + half, mask=mask, other=0.0), tl.float32)
    c1, c2, _, scale = quantize_kv(x1, x2, x1)
    tl.store(code_ptrs, c1, mask=mask)
    tl.store(code_ptrs + half, c2, mask=mask)
    tl.store(scale_ptrs, scale, mask=th_ok)


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Validates an int8 cache's scales (True) or a float cache's absence of them (False)."""
    if k_cache.dtype != torch.int8:
        check(k_scale is None and v_scale is None, "scales go with an int8 cache only")
        return False
    check(v_cache.dtype == torch.int8, "k_cache and v_cache must share a dtype")
    check(k_scale is not None and v_scale is not None, "an int8 cache needs k_scale and v_scale")
    want = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(tuple(s.shape) == want and s.is_contiguous() and s.dtype == torch.float16,
              f"{name} must be a contiguous fp16 [num_blocks, block_size, Hk] = {list(want)}")
        check(s.device == k_cache.device, f"{name} must be on the cache's device")
    return True


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_vt,
    T, HD, num_slots,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD).to(tl.int64)
    mask_t = offs_t < T
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = mask_t & (slot >= 0) & (slot < num_slots)
    mask = valid[:, None] & (offs_c < HD)[None, :]
    dst = slot[:, None] * HD + offs_c[None, :]
    dt = k_cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + offs_t[:, None] * stride_kt + offs_c[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, finite_or_zero(k, dt).to(dt), mask=mask)
    v = tl.load(v_ptr + offs_t[:, None] * stride_vt + offs_c[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, finite_or_zero(v, dt).to(dt), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hk, Dh]; k_cache, v_cache: [num_blocks, block_size, Hk, Dh]; slots: [T];
    k_scale, v_scale: [num_blocks, block_size, Hk] fp16 with an int8 cache (quantized here)."""
    check(k.dim() == 3 and k.shape == v.shape, "k and v must be [T, Hk, Dh] of equal shape")
    T, Hk, Dh = k.shape
    for name, t in (("k", k), ("v", v)):
        check(t.stride(2) == 1 and t.stride(1) == Dh, f"{name} needs (Hk, Dh) contiguous per token")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, Dh),
          f"caches must be [num_blocks, block_size, {Hk}, {Dh}]")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    check(slots.shape == (T,), "slots must be [T]")
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if T == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if quantized:
        check(Dh % 2 == 0, f"head_dim must be even, got {Dh}")
        block_t = min(64, next_pow2(T)) if INTERPRET else 1
        block_h = next_pow2(Hk) if INTERPRET else min(next_pow2(Hk), 16)
        launch(_write_kv_int8_kernel, (cdiv(T, block_t), cdiv(Hk, block_h)),
               k, v, k_cache, v_cache, k_scale, v_scale, slots, k.stride(0), v.stride(0),
               T, Hk, Dh, num_slots, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=next_pow2(Dh // 2))
        return
    hd = Hk * Dh
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_hd = min(next_pow2(hd), 8192 if INTERPRET else 1024)
    grid = (cdiv(T, block_t), cdiv(hd, block_hd))
    launch(_write_kv_kernel, grid, k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
                           T, hd, num_slots, BLOCK_T=block_t, BLOCK_HD=block_hd)


@triton.jit
def _scatter_table_kernel(table_ptr, upd_ptr, stride_row, n, num_rows, width, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = offs < n
    row = tl.load(upd_ptr + 3 * offs, mask=ok, other=-1).to(tl.int64)
    col = tl.load(upd_ptr + 3 * offs + 1, mask=ok, other=-1).to(tl.int64)
    block = tl.load(upd_ptr + 3 * offs + 2, mask=ok, other=0)
    ok = ok & (row >= 0) & (row < num_rows) & (col >= 0) & (col < width)
    tl.store(table_ptr + row * stride_row + col, block.to(table_ptr.dtype.element_ty), mask=ok)


def update_block_table(table: torch.Tensor, updates: torch.Tensor) -> None:
    """table: [R, W] int32; updates: [n, 3] int (row, column, block id): table[row, col] = block.

    The plan carries only a sequence's new blocks; this writes them into the persistent
    device table. Out-of-range entries are skipped (the interpreter would write anywhere).
    """
    check(table.dim() == 2 and table.stride(1) == 1, "table must be [R, W] with unit column stride")
    check(updates.dim() == 2 and updates.shape[1] == 3 and updates.is_contiguous(),
          "updates must be a contiguous [n, 3]")
    n = updates.shape[0]
    if n == 0:
        return
    # GPU: one fixed block (n changes every step: a block size per n would be a compile per
    # power of two while serving); the interpreter: few programs.
    block = min(1024, next_pow2(n)) if INTERPRET else 256
    launch(_scatter_table_kernel, (cdiv(n, block),), table, updates, table.stride(0), n,
           table.shape[0], table.shape[1], BLOCK=block)
