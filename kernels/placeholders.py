"""Placeholder tokens filled on the device: ``ids[pairs[0, i]] = sampled[pairs[1, i]]``.

A step planned behind another holds a placeholder where its sequences' next input token is
the one the step before samples. Filling it from that step's sampled tensor, on the device
and in stream order, lets step N+1 be launched before step N's tokens reach the host (vLLM's
async scheduling does the same): the host syncs once per step, after the next launch.

    ids:     [T]    int64   the step's input ids (placeholders at pairs[0])
    pairs:   [2, n] int64   (index into ids, index into sampled)
    sampled: [S]    int64   the previous step's sampled tokens
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch, next_pow2


@triton.jit
def _fill_placeholders_kernel(ids_ptr, pairs_ptr, sampled_ptr, stride_pair, n, num_ids,
                              num_sampled, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    dst = tl.load(pairs_ptr + offs, mask=live, other=0)
    src = tl.load(pairs_ptr + stride_pair + offs, mask=live, other=0)
    # out-of-range pairs are skipped (the interpreter would read and write anywhere)
    ok = live & (dst >= 0) & (dst < num_ids) & (src >= 0) & (src < num_sampled)
    token = tl.load(sampled_ptr + src, mask=ok, other=0)
    tl.store(ids_ptr + dst, token, mask=ok)


def fill_placeholders(ids: torch.Tensor, pairs: torch.Tensor, sampled: torch.Tensor) -> None:
    """ids[pairs[0, i]] = sampled[pairs[1, i]] for each i (in place)."""
    check(ids.dim() == 1 and ids.is_contiguous() and ids.dtype == torch.int64,
          "ids must be a contiguous int64 vector")
    check(sampled.dim() == 1 and sampled.is_contiguous() and sampled.dtype == torch.int64,
          "sampled must be a contiguous int64 vector")
    check(pairs.dim() == 2 and pairs.shape[0] == 2 and pairs.stride(1) == 1
          and pairs.dtype == torch.int64, "pairs must be [2, n] int64 with unit column stride")
    n = pairs.shape[1]
    if n == 0:
        return
    # GPU: one fixed block (n changes every step: a size per n would be a compile per power
    # of two while serving); the interpreter: one program.
    block = next_pow2(n) if INTERPRET else 256
    launch(_fill_placeholders_kernel, (cdiv(n, block),), ids, pairs, sampled, pairs.stride(0),
           n, ids.shape[0], sampled.shape[0], BLOCK=block)
