"""Row gather: ``out[t, :] = table[ids[t], :]``.

Used for the token embedding and to pick the last hidden state of each sequence before the LM
head. Ids outside ``[0, V)`` are masked (the row comes out as zeros): the interpreter does no
bounds checking, and callers validate token ids where they enter the server.

``scale`` multiplies every row (Gemma scales its embeddings by sqrt(hidden_size)): the
product is taken in fp32 and rounded once, which for a scale already rounded to the table's
dtype (as transformers rounds it) equals the product in that dtype.

Layouts: ids [T] int32/int64; table [V, D] (unit column stride); out [T, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, empty, launch, next_pow2


@triton.jit
def _gather_rows_kernel(
    ids_ptr, table_ptr, out_ptr,
    stride_tv, stride_ot,
    T, V, D, scale,
    SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    mask_t = offs_t < T
    ids = tl.load(ids_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    valid = mask_t & (ids >= 0) & (ids < V)
    mask_d = offs_d < D
    rows = tl.load(table_ptr + ids[:, None] * stride_tv + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)
    if SCALED:
        rows = (rows.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_d[None, :], rows,
             mask=mask_t[:, None] & mask_d[None, :])


def gather_rows(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None,
                scale: float | None = None) -> torch.Tensor:
    """ids: [T] int; table: [V, D] -> out: [T, D] in table's dtype (rows times ``scale``)."""
    check(ids.dim() == 1, f"ids must be 1-D, got shape {tuple(ids.shape)}")
    check(table.dim() == 2 and table.stride(1) == 1, "table must be [V, D] with unit column stride")
    T, (V, D) = ids.shape[0], table.shape
    if out is None:
        out = empty((T, D), table.dtype, table.device)
    check(out.shape == (T, D) and out.stride(1) == 1, f"out must be [{T}, {D}]")
    if T == 0:
        return out
    # Interpreter: few, large programs (cost ~ programs x ops). GPU: one row, a wide slice per program.
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_d = min(next_pow2(D), 4096 if INTERPRET else 1024)
    grid = (cdiv(T, block_t), cdiv(D, block_d))
    launch(_gather_rows_kernel, grid, ids, table, out, table.stride(0), out.stride(0), T, V, D,
           1.0 if scale is None else scale, SCALED=scale is not None, BLOCK_T=block_t,
           BLOCK_D=block_d)
    return out
