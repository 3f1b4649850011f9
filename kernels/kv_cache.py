"""KV-cache write through a slot mapping, and the block-table update of a persistent table.

    k_cache.view(-1, Hk * Dh)[slot[t]] = k[t]      (and the same for v)

A slot is ``block_id * block_size + offset_in_block``; slot -1 means "do not write" (padding).
Layouts: k, v [T, Hk, Dh] with (Hk, Dh) contiguous per token (strided views of the fused qkv
projection are fine); k_cache, v_cache [num_blocks, block_size, Hk, Dh] contiguous; slots [T].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch, next_pow2


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
    k = tl.load(k_ptr + offs_t[:, None] * stride_kt + offs_c[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + offs_t[:, None] * stride_vt + offs_c[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, Hk, Dh]; k_cache, v_cache: [num_blocks, block_size, Hk, Dh]; slots: [T]."""
    check(k.dim() == 3 and k.shape == v.shape, "k and v must be [T, Hk, Dh] of equal shape")
    T, Hk, Dh = k.shape
    for name, t in (("k", k), ("v", v)):
        check(t.stride(2) == 1 and t.stride(1) == Dh, f"{name} needs (Hk, Dh) contiguous per token")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, Dh),
          f"caches must be [num_blocks, block_size, {Hk}, {Dh}]")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    check(slots.shape == (T,), "slots must be [T]")
    if T == 0:
        return
    hd = Hk * Dh
    num_slots = k_cache.shape[0] * k_cache.shape[1]
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
