"""Token sampling on the GPU: greedy, temperature, top-k, top-p, per-row seeds, logprobs.

Per row r of logits x [B, V] (fp32), the processed logits y (x after penalties and logit_bias,
penalties.py; y = x without them) and the grammar mask M (forbidden tokens read -inf in both):

    lse      = log sum exp(x)                       (raw log-probs: x - lse, as OpenAI/vLLM report)
    (below, x stands for y: the token is chosen from the processed logits)
    greedy   : token = argmax x                     (temperature == 0; first index on ties)
    sampled  : z = x / T;  keep z >= k-th largest z (top_k > 0);
               e = exp(z - max z) over kept;  keep e >= u* where u* is the smallest cut with
               sum(e > u*) < top_p * sum(e)          (HF/vLLM top-p: drop the tail whose
                                                      complement already holds top_p)
               (tokens tied at the cut are kept together; a sort would split them arbitrarily)
               token = argmax_kept (z - log(-log(U))),  U ~ Philox(seed_r, v)   (Gumbel-max:
               an exact draw from softmax(z) renormalised over the kept set)

Thresholds are found without sorting (a vocabulary of 128K does not fit one block): a 16-way
bisection over the order-preserving int32 image of the floats, counting (top-k) or summing
(top-p) over the vocabulary in chunks per round. 8 rounds give the exact k-th value.
``top_logprobs`` picks the N best by repeated chunked argmax under the order (value desc,
index asc), which needs no sort either.
Layouts: logits, processed [B, V] fp32 (unit column stride); allowed [B, ceil(V/32)] int32
(bit t % 32 of word t // 32: token t allowed, the layout xgrammar and llguidance fill);
temperature, top_p [B] fp32; top_k [B] int32; seeds [B] int64; out tokens [B] int64,
token_logprobs [B] fp32, top ids/logprobs [B, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, empty, launch, next_pow2


@triton.jit
def _ordered_key(x):
    """float32 -> int32 with the same order (for non-NaN): flip magnitude bits of negatives."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load(row_ptrs, allowed_rows, offs_v, start, V, HAS_MASK: tl.constexpr):
    """A [BLOCK_B, BLOCK_V] chunk of logits; tokens the grammar mask forbids read -inf."""
    idx = start + offs_v
    mask = idx < V
    x = tl.load(row_ptrs + start, mask=mask[None, :], other=float("-inf"))
    if HAS_MASK:
        word = tl.load(allowed_rows + (idx // 32)[None, :], mask=mask[None, :], other=0)
        x = tl.where(((word >> (idx % 32)[None, :]) & 1) != 0, x, float("-inf"))
    return x, mask


@triton.jit
def _scaled(row_ptrs, allowed_rows, offs_v, start, V, inv_t, HAS_MASK: tl.constexpr):
    x, mask = _load(row_ptrs, allowed_rows, offs_v, start, V, HAS_MASK)
    return x * inv_t[:, None], mask


@triton.jit
def _sample_kernel(
    logits_ptr, proc_ptr, allowed_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, token_ptr,
    logprob_ptr,
    stride_lb, stride_pb, stride_ab, B, V,
    APPLY_TOP_K: tl.constexpr, APPLY_TOP_P: tl.constexpr, ALL_GREEDY: tl.constexpr,
    HAS_PROC: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = offs_b < B
    offs_v = tl.arange(0, BLOCK_V)
    rows = tl.where(b_ok, offs_b, 0)  # padded rows read row 0 and store nothing
    raw_ptrs = logits_ptr + rows[:, None] * stride_lb + offs_v[None, :]
    # The token is chosen from the processed logits (penalties, logit_bias); logprobs are
    # reported from the raw ones (vLLM's default); the grammar mask applies to both.
    row_ptrs = raw_ptrs
    if HAS_PROC:
        row_ptrs = proc_ptr + rows[:, None] * stride_pb + offs_v[None, :]
    allowed_rows = allowed_ptr + rows[:, None] * stride_ab

    # Pass 1: greedy argmax of the processed logits, logsumexp of the raw ones.
    m = tl.full([BLOCK_B], float("-inf"), tl.float32)
    m_r = tl.full([BLOCK_B], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_B], tl.float32)
    best = tl.zeros([BLOCK_B], tl.int64)
    for start in range(0, V, BLOCK_V):
        x, mask = _load(row_ptrs, allowed_rows, offs_v, start, V, HAS_MASK)
        cmax, cidx = tl.max(x, axis=1, return_indices=True)
        best = tl.where(cmax > m, cidx.to(tl.int64) + start, best)
        m = tl.maximum(m, cmax)
        if HAS_PROC:
            x, mask = _load(raw_ptrs, allowed_rows, offs_v, start, V, HAS_MASK)
        m_new = tl.maximum(m_r, tl.max(x, axis=1))
        # A chunk the mask forbids whole, before any allowed token: -inf - -inf is NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m_r - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), axis=1)
        m_r = m_new
    lse = m_r + tl.log(s)
    token = best

    if not ALL_GREEDY:
        temp = tl.load(temp_ptr + offs_b, mask=b_ok, other=0.0)
        inv_t = 1.0 / tl.where(temp > 0.0, temp, 1.0)
        z_max = m * inv_t

        # Both thresholds are found by 16-way bisection: each probe counts (top-k) or sums
        # (top-p) against 16 cut points at once, so 8 rounds cover the 32-bit key space.
        fan = tl.arange(0, 16).to(tl.int64)

        # top-k: the largest cut t with count(key >= t) >= k, i.e. the k-th largest key.
        k_cut = tl.full([BLOCK_B], -2147483648, tl.int64)
        if APPLY_TOP_K:
            k = tl.load(top_k_ptr + offs_b, mask=b_ok, other=0).to(tl.int64)
            k = tl.where((k <= 0) | (k > V), V, k)
            lo = tl.full([BLOCK_B], -2147483648, tl.int64)  # count(key >= lo) >= k holds
            hi = tl.full([BLOCK_B], 2147483647, tl.int64)
            for _ in range(8):
                step = (hi - lo + 16) // 16
                cuts = lo[:, None] + fan[None, :] * step[:, None]  # [BLOCK_B, 16]
                cnt = tl.full([BLOCK_B, 16], 0, tl.int64)
                for start in range(0, V, BLOCK_V):
                    z, mask = _scaled(row_ptrs, allowed_rows, offs_v, start, V, inv_t, HAS_MASK)
                    key = _ordered_key(z).to(tl.int64)
                    ge = (key[:, None, :] >= cuts[:, :, None]) & mask[None, None, :]
                    cnt += tl.sum(ge.to(tl.int64), axis=2)
                ok = (cnt >= k[:, None]) & (cuts <= hi[:, None])
                j = tl.max(tl.where(ok, fan[None, :], 0), axis=1)
                lo = lo + j * step
                hi = tl.minimum(hi, lo + step - 1)
            k_cut = lo

        # top-p: the smallest cut u on e = exp(z - z_max) (positive floats: int bits ordered)
        # with mass(e > u) < top_p * mass(kept).
        p_cut = tl.full([BLOCK_B], 0, tl.int64)
        if APPLY_TOP_P:
            top_p = tl.load(top_p_ptr + offs_b, mask=b_ok, other=1.0)
            total = tl.full([BLOCK_B], 0.0, tl.float32)
            for start in range(0, V, BLOCK_V):
                z, mask = _scaled(row_ptrs, allowed_rows, offs_v, start, V, inv_t, HAS_MASK)
                kept = (_ordered_key(z).to(tl.int64) >= k_cut[:, None]) & mask[None, :]
                total += tl.sum(tl.where(kept, tl.exp(z - z_max[:, None]), 0.0), axis=1)
            goal = top_p * total
            lo = tl.full([BLOCK_B], 0, tl.int64)
            hi = tl.full([BLOCK_B], 0x3F800000, tl.int64)  # mass(e > 1.0) = 0 < goal holds
            for _ in range(8):
                step = (hi - lo + 16) // 16
                cuts = lo[:, None] + fan[None, :] * step[:, None]
                above = tl.full([BLOCK_B, 16], 0.0, tl.float32)
                for start in range(0, V, BLOCK_V):
                    z, mask = _scaled(row_ptrs, allowed_rows, offs_v, start, V, inv_t, HAS_MASK)
                    e = tl.exp(z - z_max[:, None])
                    kept = (_ordered_key(z).to(tl.int64) >= k_cut[:, None]) & mask[None, :]
                    e_key = e.to(tl.int32, bitcast=True).to(tl.int64)
                    gt = kept[:, None, :] & (e_key[:, None, :] > cuts[:, :, None])
                    above += tl.sum(tl.where(gt, e[:, None, :], 0.0), axis=2)
                ok = (above < goal[:, None]) & (cuts <= hi[:, None])
                j = tl.min(tl.where(ok, fan[None, :], 16), axis=1)  # first cut below the goal
                new_lo = tl.where(j == 0, lo, lo + (j - 1) * step + 1)
                hi = tl.where(j == 16, hi, lo + j * step)
                lo = new_lo
            p_cut = tl.where(top_p < 1.0, lo, 0)

        # Gumbel-max draw over the kept set (a banned or masked token is -inf: never drawn).
        seed = tl.load(seed_ptr + offs_b, mask=b_ok, other=0)
        g_best = tl.full([BLOCK_B], float("-inf"), tl.float32)
        g_idx = tl.zeros([BLOCK_B], tl.int64)
        for start in range(0, V, BLOCK_V):
            z, mask = _scaled(row_ptrs, allowed_rows, offs_v, start, V, inv_t, HAS_MASK)
            e = tl.exp(z - z_max[:, None])
            kept = (_ordered_key(z).to(tl.int64) >= k_cut[:, None]) \
                & (e.to(tl.int32, bitcast=True).to(tl.int64) >= p_cut[:, None]) & mask[None, :] \
                & (z > float("-inf"))
            u = tl.rand(seed[:, None], (start + offs_v)[None, :])
            score = tl.where(kept, z - tl.log(-tl.log(u)), float("-inf"))
            cmax, cidx = tl.max(score, axis=1, return_indices=True)
            g_idx = tl.where(cmax > g_best, cidx.to(tl.int64) + start, g_idx)
            g_best = tl.maximum(g_best, cmax)
        token = tl.where((temp > 0.0) & (g_best > float("-inf")), g_idx, best)

    x_tok = tl.load(logits_ptr + offs_b * stride_lb + token, mask=b_ok, other=0.0)
    tl.store(token_ptr + offs_b, token, mask=b_ok)
    tl.store(logprob_ptr + offs_b, x_tok - lse, mask=b_ok)


@triton.jit(do_not_specialize=["stride_tb", "N"])  # N = 1 or 16 would each compile anew
def _top_logprobs_kernel(
    logits_ptr, allowed_ptr, logprob_ptr, top_ids_ptr, top_lp_ptr, token_ptr,
    stride_lb, stride_ab, stride_tb, B, V, N,
    HAS_MASK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """N rounds of argmax, each below the previous pick in (value desc, index asc) order."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = offs_b < B
    offs_v = tl.arange(0, BLOCK_V).to(tl.int64)
    rows = tl.where(b_ok, offs_b, 0)
    row_ptrs = logits_ptr + rows[:, None] * stride_lb + offs_v[None, :]
    allowed_rows = allowed_ptr + rows[:, None] * stride_ab
    # lse = x[token] - logprob[token], from the sampling pass.
    token = tl.load(token_ptr + offs_b, mask=b_ok, other=0)
    lp_tok = tl.load(logprob_ptr + offs_b, mask=b_ok, other=0.0)
    lse = tl.load(logits_ptr + offs_b * stride_lb + token, mask=b_ok, other=0.0) - lp_tok
    prev_v = tl.full([BLOCK_B], float("inf"), tl.float32)
    prev_i = tl.full([BLOCK_B], -1, tl.int64)
    for n in range(0, N):
        best_v = tl.full([BLOCK_B], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_B], V, tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs_v
            x, _ = _load(row_ptrs, allowed_rows, offs_v, start, V, HAS_MASK)
            below = (x < prev_v[:, None]) | ((x == prev_v[:, None]) & (idx[None, :] > prev_i[:, None]))
            x = tl.where(below & (idx < V)[None, :], x, float("-inf"))
            cmax, cidx = tl.max(x, axis=1, return_indices=True)
            cidx = cidx.to(tl.int64) + start
            better = (cmax > best_v) | ((cmax == best_v) & (cidx < best_i))
            best_i = tl.where(better, cidx, best_i)
            best_v = tl.where(better, cmax, best_v)
        tl.store(top_ids_ptr + offs_b * stride_tb + n, best_i, mask=b_ok)
        # The token's own entry is its logprob bit for bit (x - (x - lp) may round): clients
        # (lm-eval's is_greedy) compare the two with ==.
        tl.store(top_lp_ptr + offs_b * stride_tb + n,
                 tl.where(best_i == token, lp_tok, best_v - lse), mask=b_ok)
        prev_v = best_v
        prev_i = best_i


@triton.jit
def _target_logprob_kernel(
    logits_ptr, target_ptr, logprob_ptr, rank_ptr,
    stride_lb, B, V,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row r: log softmax(x)[target_r] and its rank (1 + tokens strictly more likely)."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = offs_b < B
    offs_v = tl.arange(0, BLOCK_V)
    rows = tl.where(b_ok, offs_b, 0)
    row_ptrs = logits_ptr + rows[:, None] * stride_lb + offs_v[None, :]
    target = tl.load(target_ptr + offs_b, mask=b_ok, other=0)
    x_t = tl.load(logits_ptr + rows * stride_lb + target)
    m = tl.full([BLOCK_B], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_B], tl.float32)
    above = tl.zeros([BLOCK_B], tl.int64)
    for start in range(0, V, BLOCK_V):
        mask = (start + offs_v) < V
        x = tl.load(row_ptrs + start, mask=mask[None, :], other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        above += tl.sum((x > x_t[:, None]).to(tl.int64), axis=1)
    tl.store(logprob_ptr + offs_b, x_t - (m + tl.log(s)), mask=b_ok)
    tl.store(rank_ptr + offs_b, above + 1, mask=b_ok)


MAX_TILE = 1 << 20  # elements in one Triton tensor


def _tiles(B: int, V: int, fan: int = 1) -> tuple[int, int, tuple[int]]:
    """Rows per program and vocabulary chunk: one row per program on a GPU (a row's passes
    are long), many under the interpreter (its cost is per program). ``fan``: the widest
    tensor is [rows, fan, chunk] (the bisection's 16 cut points); Triton caps a tensor at
    2^20 elements, so 65,536-wide chunks go 16 rows at a time, or one with the cut points."""
    block_v = min(next_pow2(V), 65536 if INTERPRET else 2048)
    block_b = max(1, min(256, next_pow2(B), MAX_TILE // (fan * block_v))) if INTERPRET else 1
    return block_b, block_v, (cdiv(B, block_b),)


def _top(logits: torch.Tensor, allowed: torch.Tensor | None, logprobs: torch.Tensor,
         tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The N best (ids [B, N], logprobs [B, N]) of each row, given a token of each and its
    logprob (they fix the row's logsumexp); None when N is 0."""
    if num_top <= 0:
        return None, None
    B, V = logits.shape
    n = min(num_top, V)
    top_ids = empty((B, n), torch.int64, logits.device)
    top_lp = empty((B, n), torch.float32, logits.device)
    mask = tokens if allowed is None else allowed  # (any tensor: never read without HAS_MASK)
    block_b, block_v, grid = _tiles(B, V)
    launch(_top_logprobs_kernel, grid, logits, mask, logprobs, top_ids, top_lp, tokens,
           logits.stride(0), mask.stride(0), top_ids.stride(0), B, V, n,
           HAS_MASK=allowed is not None, BLOCK_B=block_b, BLOCK_V=block_v, num_warps=8)
    return top_ids, top_lp


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top_logprobs: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                               torch.Tensor | None]:
    """logits [R, V] fp32, targets [R] int64 (the token that did come next: a prompt's)
    -> (logprobs [R], ranks [R] int64, top ids [R, N], top logprobs [R, N]); a target among
    the top N carries the same logprob bit for bit in both."""
    check(logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1,
          "logits must be [R, V] float32 with unit column stride")
    R, V = logits.shape
    check(targets.shape == (R,) and targets.dtype == torch.int64, f"targets must be [{R}] int64")
    logprobs = empty((R,), torch.float32, logits.device)
    ranks = empty((R,), torch.int64, logits.device)
    if R == 0:
        return logprobs, ranks, None, None
    block_b, block_v, grid = _tiles(R, V)
    launch(_target_logprob_kernel, grid, logits, targets, logprobs, ranks, logits.stride(0),
           R, V, BLOCK_B=block_b, BLOCK_V=block_v, num_warps=8)
    top_ids, top_lp = _top(logits, None, logprobs, targets, num_top_logprobs)
    return logprobs, ranks, top_ids, top_lp


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, num_top_logprobs: int = 0,
           *, all_greedy: bool = False, any_top_k: bool = True, any_top_p: bool = True,
           processed: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits: [B, V] fp32 -> (tokens [B] int64, logprobs [B], top ids [B, N], top logprobs [B, N]).

    ``processed`` [B, V] fp32: the logits after penalties and logit_bias, to choose from
    (logprobs still come from ``logits``); ``allowed`` [B, ceil(V / 32)] int32: the grammar
    bitmask (bit t % 32 of word t // 32 set: token t allowed), applied to both; a row of all
    ones leaves a row unconstrained. The keyword flags are host-side facts about the batch
    that let the kernel skip whole passes (the per-row parameters stay authoritative).
    """
    check(logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1,
          "logits must be [B, V] float32 with unit column stride")
    B, V = logits.shape
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                        ("top_p", top_p, torch.float32), ("seeds", seeds, torch.int64)):
        check(t.shape == (B,) and t.dtype == dt, f"{name} must be [{B}] {dt}")
    if processed is not None:
        check(processed.shape == (B, V) and processed.dtype == torch.float32
              and processed.stride(1) == 1, f"processed must be [{B}, {V}] float32")
    if allowed is not None:
        check(allowed.shape == (B, cdiv(V, 32)) and allowed.dtype == torch.int32
              and allowed.stride(1) == 1, f"allowed must be [{B}, {cdiv(V, 32)}] int32")
    tokens = empty((B,), torch.int64, logits.device)
    logprobs = empty((B,), torch.float32, logits.device)
    if B == 0:
        return tokens, logprobs, None, None
    bisect = not all_greedy and (any_top_k or any_top_p)
    block_b, block_v, grid = _tiles(B, V, 16 if bisect else 1)
    proc = logits if processed is None else processed
    mask = tokens if allowed is None else allowed  # (any tensor: never read without HAS_MASK)
    launch(_sample_kernel, grid,
        logits, proc, mask, temperature, top_k, top_p, seeds, tokens, logprobs,
        logits.stride(0), proc.stride(0), mask.stride(0), B, V,
        APPLY_TOP_K=any_top_k and not all_greedy, APPLY_TOP_P=any_top_p and not all_greedy,
        ALL_GREEDY=all_greedy, HAS_PROC=processed is not None, HAS_MASK=allowed is not None,
        BLOCK_B=block_b, BLOCK_V=block_v, num_warps=8)
    top_ids, top_lp = _top(logits, allowed, logprobs, tokens, num_top_logprobs)
    return tokens, logprobs, top_ids, top_lp
