"""MoE routing and the expert sort: which experts each token uses, and the (token, expert)
pairs grouped into expert tiles for moe.py's grouped GEMMs.

    weights, ids = moe_route(logits, k)       [T, k] fp32, [T, k] int32 (one program a row block)
    softmax_first  p = softmax(logits); the k largest; renormalize: p / sum of the k
                   (Qwen2/3-MoE, OLMoE; Mixtral is this with renormalize)
    otherwise      the k largest logits v; w = softmax(v) (gpt-oss); renormalize is moot
    Order: descending logit, ties to the lower expert id (torch.topk leaves ties unspecified).
    E <= 256, k <= 16. Rows need one finite logit; NaN logits are not supported.
    counts (optional, the operator's expert load): counts[e] += the rows that picked e, rows
    with a KV slot only (``rows``: the step's slot mapping; a bucket's padding has -1). One
    atomic add per expert per program: integers, so the total is exact in any order.

The sort (``moe_align``): the flat entries f = t*k + j grouped by expert, experts in id order,
ascending f within an expert (one answer for given ids: deterministic), each expert's run
padded to a multiple of block_m with the sentinel T*k; expert_of_tile[i] is tile i's expert,
-1 past the used tiles. block_m = 4, expert 1 without tokens (it costs no tile), S the static
size:

    sorted_ids     | 0  5  9  S | 1  2  4  6  7  S  S  S | 3  S  S  S | S  S ... S |
    expert_of_tile     0            2           2            3          -1 ... -1

S = ceil((T*k + min(E, T*k) * (block_m - 1)) / block_m) * block_m, the worst case, so the
buffers are static for a batch size (CUDA graphs capture the sort and both GEMMs). Three
kernels, no torch sort: per-chunk expert counts (and the sentinel fill), one program for the
offsets (each expert's start, each chunk's base in it, the tiles' experts), and placement by
rank within the chunk (a cumulative sum over the chunk's one-hot rows). Ids outside [0, E)
are left out of the sort (never read out of bounds) and their h / y rows are not written:
pass the router's ids. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, empty, launch, next_pow2

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS, MAX_TOP_K = 256, 16


# ---------------------------------------------------------------------------------- routing

@triton.jit
def _ordered_key(x):
    """fp32 -> int64 in the same order (non-NaN; -0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float whose ``_ordered_key`` is key."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _moe_route_kernel(
    logits_ptr, weights_ptr, ids_ptr, counts_ptr, rows_ptr, T, E, stride_lt, stride_le,
    TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    COUNT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < T
    mask_e = offs_e < E
    rows = tl.where(mask_t, offs_t, 0)  # padding rows read row 0 and store nothing
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + offs_e[None, :] * stride_le,
                mask=mask_e[None, :], other=float("-inf")).to(tl.float32)
    # k rounds of max: the lowest id among the largest; a taken (or padding) expert's key
    # drops below every float's, -inf's included
    key = tl.where(mask_e[None, :], _ordered_key(x), -(2**40))
    top = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)  # the chosen logits, descending
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    if COUNT:
        counted = mask_t & (tl.load(rows_ptr + rows, mask=mask_t, other=-1) >= 0)
        per_expert = tl.zeros([BLOCK_E], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        idx = tl.min(tl.where(key == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        hit = offs_e[None, :] == idx[:, None]
        key = tl.where(hit, -(2**40), key)
        top = tl.where(offs_k[None, :] == j, _key_value(best)[:, None], top)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        if COUNT:
            per_expert += tl.sum((hit & counted[:, None]).to(tl.int64), axis=0)
    if COUNT:
        tl.atomic_add(counts_ptr + offs_e, per_expert, mask=mask_e & (per_expert > 0))
    chosen = offs_k[None, :] < TOP_K
    m = tl.max(x, axis=1)
    if SOFTMAX_FIRST:
        w = tl.exp(top - m[:, None]) / tl.sum(tl.exp(x - m[:, None]), axis=1)[:, None]
        if RENORMALIZE:
            w = tl.where(chosen, w, 0.0)
            w = w / tl.sum(w, axis=1)[:, None]
    else:
        e = tl.where(chosen, tl.exp(top - m[:, None]), 0.0)
        w = e / tl.sum(e, axis=1)[:, None]
    out = offs_t[:, None] * TOP_K + offs_k[None, :]
    tl.store(weights_ptr + out, w, mask=mask_t[:, None] & chosen)
    tl.store(ids_ptr + out, ids, mask=mask_t[:, None] & chosen)


def moe_route(router_logits: torch.Tensor, top_k: int, *, softmax_first: bool,
              renormalize: bool, counts: torch.Tensor | None = None,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] float (E <= 256) -> (weights [T, k] fp32, ids [T, k] int32), each
    row by descending logit, ties to the lower id (module docstring for the two modes).
    ``counts`` [E] int64 and ``rows`` [T] int64 (the slot mapping): counts[e] += the rows with
    a slot that picked e."""
    check(router_logits.dim() == 2 and router_logits.dtype in FLOATS,
          "router_logits must be a float [T, E]")
    T, E = router_logits.shape
    check(1 <= E <= MAX_EXPERTS, f"the router has {E} experts: 1 to {MAX_EXPERTS} supported")
    check(1 <= top_k <= min(E, MAX_TOP_K), f"top_k must be in [1, {min(E, MAX_TOP_K)}], got {top_k}")
    dev = router_logits.device
    if counts is not None:
        check(counts.shape == (E,) and counts.dtype == torch.int64 and counts.is_contiguous()
              and counts.device == dev, f"counts must be a contiguous int64 [{E}]")
        check(rows is not None and rows.shape == (T,) and rows.dtype == torch.int64
              and rows.is_contiguous() and rows.device == dev,
              f"rows must be the step's contiguous int64 [{T}] slot mapping")
    weights = empty((T, top_k), torch.float32, dev)
    ids = empty((T, top_k), torch.int32, dev)
    if T == 0:
        return weights, ids
    block_t = min(64, next_pow2(T)) if INTERPRET else 8  # rows never mix: any block is exact
    count = counts is not None
    launch(_moe_route_kernel, (cdiv(T, block_t),), router_logits, weights, ids,
           counts if count else ids, rows if count else ids, T, E,
           router_logits.stride(0), router_logits.stride(1), TOP_K=top_k,
           SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize, COUNT=count, BLOCK_T=block_t,
           BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(top_k))
    return weights, ids


# ---------------------------------------------------------------------------- the expert sort

@triton.jit
def _one_hot(ids, E, BLOCK_E: tl.constexpr):
    """[CHUNK] expert ids -> [CHUNK, BLOCK_E] int32 one-hot rows (ids outside [0, E): zeros)."""
    offs_e = tl.arange(0, BLOCK_E)
    return ((ids[:, None] == offs_e[None, :]) & (offs_e < E)[None, :]).to(tl.int32)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, sorted_ptr, N, E, S, fill_per,
                      CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_FILL: tl.constexpr):
    """counts[c, e]: chunk c's entries for expert e. Also sets this program's share of
    sorted_ids to the sentinel N; the placement kernel (launched after) writes the entries."""
    c = tl.program_id(0).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + c * E + offs_e, tl.sum(_one_hot(ids, E, BLOCK_E), axis=0),
             mask=offs_e < E)
    lo = c * fill_per
    hi = tl.minimum(lo + fill_per, S)
    offs_s = tl.arange(0, BLOCK_FILL).to(tl.int64)
    for p in range(lo, hi, BLOCK_FILL):
        tl.store(sorted_ptr + p + offs_s, tl.zeros([BLOCK_FILL], tl.int32) + N,
                 mask=p + offs_s < hi)


@triton.jit
def _moe_offsets_kernel(counts_ptr, base_ptr, tile_expert_ptr, num_tiles_ptr,
                        n_chunks, E, n_tiles, block_m,
                        BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """One program: expert e's run starts at the sum of the earlier experts' padded counts;
    chunk c's entries of e start after the earlier chunks' (base[c, e]); tile i belongs to the
    expert whose run holds position i * block_m (-1 past the last run)."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_c = tl.arange(0, BLOCK_C)
    total = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        mask = ((c0 + offs_c) < n_chunks)[:, None] & mask_e[None, :]
        total += tl.sum(tl.load(counts_ptr + (c0 + offs_c)[:, None] * E + offs_e[None, :],
                                mask=mask, other=0), axis=0)
    padded = (total + block_m - 1) // block_m * block_m
    end = tl.cumsum(padded, axis=0)  # each run's end; an empty run ends where it starts
    run = end - padded
    for c0 in range(0, n_chunks, BLOCK_C):
        mask = ((c0 + offs_c) < n_chunks)[:, None] & mask_e[None, :]
        ptrs = (c0 + offs_c)[:, None] * E + offs_e[None, :]
        cnt = tl.load(counts_ptr + ptrs, mask=mask, other=0)
        tl.store(base_ptr + ptrs, run[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=mask)
        run += tl.sum(cnt, axis=0)
    tl.store(num_tiles_ptr, tl.sum(padded, axis=0) // block_m)
    offs_i = tl.arange(0, BLOCK_TILES)
    for i0 in range(0, n_tiles, BLOCK_TILES):
        first = (i0 + offs_i) * block_m
        # runs that end at or before the tile's first row: their count is the tile's expert
        e = tl.sum(((end[None, :] <= first[:, None]) & mask_e[None, :]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + i0 + offs_i, tl.where(e < E, e, -1),
                 mask=(i0 + offs_i) < n_tiles)


@triton.jit
def _moe_place_kernel(ids_ptr, base_ptr, sorted_ptr, N, E,
                      CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """sorted_ids[base[c, e_f] + (entries of e_f before f in chunk c)] = f."""
    c = tl.program_id(0).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    ok = (offs < N) & (ids >= 0) & (ids < E)
    hot = _one_hot(ids, E, BLOCK_E)
    rank = tl.sum(tl.where(hot != 0, tl.cumsum(hot, axis=0), 0), axis=1) - 1
    base = tl.load(base_ptr + c * E + ids, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=ok)


def _align_blocks(N: int, E: int) -> tuple[int, int, int]:
    """(CHUNK, BLOCK_C, BLOCK_TILES): entries per counting / placing program (a [CHUNK, BLOCK_E]
    one-hot each; the sort's answer does not depend on it), chunks and tiles per step of the
    offsets program."""
    if INTERPRET:  # few, large programs
        return min(4096, max(16, next_pow2(N))), 64, 1024
    # NOTE (ptxas, sm_90): E = 256 with 64 x 256 offsets steps took 255 registers and spilled;
    # 1024 x 16 placing chunks, 255 registers. The offsets program's [chunks or tiles, E] steps
    # of 8192 elements spilled too (80-824 B of stack at a 2048-token prefill: its arguments'
    # divisibility changes the code); 2048 fit at every MoE shape of gpu_compile_check.py
    block_e = next_pow2(E)
    return max(16, min(256, 16384 // block_e)), max(8, 2048 // block_e), max(8, 2048 // block_e)


def _scratch(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat [n] buffer whose size is no multiple of the tokens, as one [1, n] row: a
    recording's pool hands out rows (up to its token capacity) and keys on the rest."""
    return empty((1, n), dtype, device)[0]


def sorted_size(num_entries: int, num_experts: int, block_m: int) -> int:
    """S: the sort's static length for T*k entries (the worst case: each hit expert pads)."""
    worst = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return cdiv(worst, block_m) * block_m


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, k] int32 -> (sorted_ids [S] int32, expert_of_tile [S // block_m] int32,
    num_tiles [1] int32: the used tiles), S = ``sorted_size(T*k, E, block_m)``; module
    docstring for the layout. Nothing is read back to the host."""
    check(ids.dim() == 2 and ids.dtype == torch.int32 and ids.is_contiguous(),
          "ids must be a contiguous int32 [T, k]")
    check(1 <= num_experts <= MAX_EXPERTS, f"num_experts must be in [1, {MAX_EXPERTS}]")
    check(block_m >= 1, f"block_m must be >= 1, got {block_m}")
    N, E, dev = ids.numel(), num_experts, ids.device
    S = sorted_size(N, E, block_m)
    check(S < 2**31, f"{N} entries: the sort's positions must fit int32")
    sorted_ids = _scratch(S, torch.int32, dev)
    expert_of_tile = _scratch(S // block_m, torch.int32, dev)
    num_tiles = _scratch(1, torch.int32, dev)
    if N == 0:
        num_tiles.zero_()
        return sorted_ids, expert_of_tile, num_tiles
    chunk, block_c, block_tiles = _align_blocks(N, E)
    n_chunks, block_e = cdiv(N, chunk), next_pow2(E)
    counts = _scratch(n_chunks * E, torch.int32, dev)
    base = _scratch(n_chunks * E, torch.int32, dev)
    fill_per = cdiv(S, n_chunks)
    launch(_moe_count_kernel, (n_chunks,), ids, counts, sorted_ids, N, E, S, fill_per,
           CHUNK=chunk, BLOCK_E=block_e, BLOCK_FILL=1024)
    launch(_moe_offsets_kernel, (1,), counts, base, expert_of_tile, num_tiles, n_chunks, E,
           S // block_m, block_m, BLOCK_C=block_c, BLOCK_E=block_e, BLOCK_TILES=block_tiles)
    launch(_moe_place_kernel, (n_chunks,), ids, base, sorted_ids, N, E, CHUNK=chunk,
           BLOCK_E=block_e)
    return sorted_ids, expert_of_tile, num_tiles
