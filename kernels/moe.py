"""Mixture-of-experts feed-forward, fused the way vLLM and SGLang do it: route and sort
(moe_routing.py), two grouped GEMMs over expert tiles, a fixed-order sum (no atomics).

    f = t * k + j  (a flat entry: token t's j-th expert e_f = ids[t, j], routing weight w_f)
    h[f]   = act(x[t] @ w13[e_f].T + b13[e_f])            [T*k, F]  x's dtype
    y[f]   = w_f * (h[f] @ w2[e_f].T + b2[e_f])           [T*k, D]  x's dtype
    out[t] = y[t*k] + y[t*k + 1] + ... + y[t*k + k - 1]   [T, D]    summed in fp32, that order

The GEMMs (one kernel, ``_moe_gemm_kernel``): program (tile i, column block n); a tile of
expert -1 returns at once. A rows are gathered (x[f // k] for gate/up, h[f] for down),
padding rows masked; B is the tile's expert's [N, K] matrix, K stepped in BLOCK_K in order,
fp32 accumulator, bias / activation / routing weight on it, one rounding at the store. h and
y are indexed by flat id, so the down GEMM gathers h as gate/up gathers x and combine reads
each token's k rows contiguously. Activations (gate, up: the two halves of w13's rows):
    silu        silu(gate) * up                         gate = w13 rows [0, F), up [F, 2F)
    gelu_tanh   gelu_tanh(gate) * up                    (activation.py's formula)
    swiglu_oai  gate = min(gate, limit), up = clamp(up, -limit, limit),
                (up + 1) * gate * sigmoid(alpha * gate) gate = even rows, up = odd (gpt-oss)
Biases (gpt-oss): b13 [E, 2F] in w13's row layout, b2 [E, D] added before the weight w_f.
Weights are float (x's dtype), int8 per output channel (``--quantization int8``: w ~= w_q *
scale[e, n], matmul.py's format per expert) or int4 group-wise with zero points
(``--quantization int4``: group_matmul.py's format per expert, codes [E, N, K_pad / 8] int32,
scales and zeros [E, N, K_pad / G]). int8: a tile of codes becomes x's dtype in registers
(exact: |q| <= 127) and the scale, which factors out of the K-sum, multiplies the accumulator
once, before bias and activation. int4: each K step lies inside one group; its tile is
dequantized in registers ((q - z) * s, group_matmul.py's helpers) into x's dtype. The fp
weights never exist.

Batch invariance: a row's result depends on its x row, its expert's weights and the shape:
block_m comes from (E, dtype) (``moe_block_m``), BLOCK_N / BLOCK_K from (N, K, dtype), never T;
K is summed in one fixed order (no split-K yet); routing reduces along a row only; combine adds
in j order. The interpreter's tl.dot is row-stable (kernels/interpreter.py). So a token's
output is bit-identical alone and in any batch.

Cost: 2 * (T*k rows + padding) * (2F * D + D * F) FLOPs; bytes ~ the touched experts' weights
(E_hit * 3 * F * D * w) + T*k * (D + F) * (reads + writes). GPU tiles are not yet timed
(ptxas, sm_90: no spills at Qwen3-30B-A3B, gpt-oss-20b and Mixtral shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.jitmath import tanh
from tinyserve.kernels.moe_int4 import Int4Experts, _k_loop_int4
from tinyserve.kernels.moe_routing import FLOATS, MAX_TOP_K, moe_align, moe_route
from tinyserve.kernels.utils import INTERPRET, cdiv, check, dot_precision, empty, launch, next_pow2

ACTIVATIONS = {"silu": 1, "gelu_tanh": 2, "swiglu_oai": 3}


def moe_block_m(num_experts: int, dtype: torch.dtype) -> int:
    """Rows per expert tile, per model (never per batch: batch invariance). The interpreter
    pays its tl.dot per row, padding included: 16. GPU: 16 (tl.dot's minimum) when experts are
    many and small (a decode step gives each ~T*k/E rows: a taller tile is mostly padding),
    64 for a few large ones (Mixtral's 8). Not yet timed on a GPU."""
    if INTERPRET or dtype == torch.float32 or num_experts > 16:
        return 16
    return 64


# ------------------------------------------------------------------------ the grouped GEMMs

@triton.jit
def _weight_tile(w_ptrs, mask, dtype):
    """A [BLOCK_K, BLOCK_N] tile of the expert's weights in the activations' dtype (int8 codes
    convert exactly; their scale is applied to the accumulator)."""
    return tl.load(w_ptrs, mask=mask, other=0).to(dtype)


@triton.jit
def _k_loop(a_rows, w_ptrs, up_off, rows, mask_n, K, stride_ak, stride_wn, stride_wk,
            GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """(sum_k a[m, k] * w[n, k], the same for the up rows n + up_off when GATED), fp32 from
    zero, K in BLOCK_K steps in order. a_rows [BLOCK_M, 1]: the gathered rows' pointers; w_ptrs
    [BLOCK_K, BLOCK_N]: the expert's first K step. The up rows share each loaded a tile."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_rows + offs_k[None, :] * stride_ak
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = (offs_k + k) < K
        a = tl.load(a_ptrs, mask=rows[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        acc = tl.dot(a, _weight_tile(w_ptrs, w_mask, a.dtype), acc, input_precision=DOT_PREC)
        if GATED:
            acc_up = tl.dot(a, _weight_tile(w_ptrs + up_off * stride_wn, w_mask, a.dtype),
                            acc_up, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, zeros_ptr, bias_ptr, rw_ptr, sorted_ptr, tile_expert_ptr, out_ptr,
    n_flat, N, K, K_pad, E, a_div, up_off, alpha, limit,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    stride_be, stride_bn, stride_om, stride_on,
    ACT: tl.constexpr, ROW_STEP: tl.constexpr, W_QUANT: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # ACT 0: out[f] = (a[f] @ w[e].T + b[e]) * rw[f] (down); 1-3: act(gate, up) (gate/up)
    # W_QUANT 0: float weights; 1: int8 codes, a scale per row; 2: int4 codes, group-wise
    GATED: tl.constexpr = ACT != 0
    pid_m = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= E):  # past the used tiles (-1): nothing to read or write
        return
    f = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = (f >= 0) & (f < n_flat)  # the rest are the sentinel (padding)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    w_rows = offs_n * ROW_STEP  # the gate's (or only) weight rows; up's are + up_off
    a_rows = a_ptr + (f // a_div)[:, None] * stride_am
    if W_QUANT == 2:
        acc, acc_up = _k_loop_int4(a_rows, w_ptr + expert * stride_we,
                                   scale_ptr + expert * stride_se, zeros_ptr + expert * stride_se,
                                   w_rows, up_off, rows, mask_n, K, K_pad, stride_ak, stride_wn,
                                   stride_wk, stride_sn, stride_sg, GATED, BLOCK_M, BLOCK_N,
                                   BLOCK_K, GROUP, DOT_PREC)
    else:
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk \
            + w_rows[None, :] * stride_wn
        acc, acc_up = _k_loop(a_rows, w_ptrs, up_off, rows, mask_n, K, stride_ak, stride_wn,
                              stride_wk, GATED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
    if W_QUANT == 1:  # per output channel: out[m, n] = scale[e, n] * sum_k a[m, k] q[n, k]
        s_ptrs = scale_ptr + expert * stride_se + w_rows * stride_sn
        acc = acc * tl.load(s_ptrs, mask=mask_n, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_ptrs + up_off * stride_sn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + w_rows * stride_bn
        acc += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + up_off * stride_bn, mask=mask_n,
                              other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # silu
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACT == 2:  # gelu_tanh
        acc = 0.5 * acc * (1.0 + tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc))) \
            * acc_up
    elif ACT == 3:  # swiglu_oai
        g = tl.minimum(acc, limit)
        u = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    if MUL_WEIGHT:
        acc = acc * tl.load(rw_ptr + f, mask=rows, other=0.0)[:, None]
    tl.store(out_ptr + f[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & mask_n[None, :])


def _gemm_tiles(N: int, K: int, dtype: torch.dtype, gated: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) by (N, K, dtype) only; BLOCK_M is the sort's block_m."""
    if INTERPRET:  # few, large programs: cost is ~ programs x ops, not FLOPs
        return min(1024, max(16, next_pow2(N))), min(256, max(16, next_pow2(K)))
    if dtype == torch.float32:  # ieee fp32 runs on FMA units
        return 32 if gated else 64, 32
    return 64 if gated else 128, 64  # gated: two accumulators


def _block_m(sorted_ids: torch.Tensor, expert_of_tile: torch.Tensor,
             device: torch.device) -> int:
    for name, t in (("sorted_ids", sorted_ids), ("expert_of_tile", expert_of_tile)):
        check(t.dim() == 1 and t.dtype == torch.int32 and t.stride(0) == 1 and t.device == device,
              f"{name} must be a contiguous int32 vector on the activations' device")
    tiles = expert_of_tile.numel()
    block_m = sorted_ids.numel() // max(tiles, 1)
    check(block_m * tiles == sorted_ids.numel() and block_m >= 16 and block_m & (block_m - 1) == 0,
          f"sorted_ids ({sorted_ids.numel()}) must be {tiles} tiles of a power-of-two block_m "
          ">= 16 (moe_align's)")
    return block_m


def _gemm(a, w, scale, bias, rw, sorted_ids, expert_of_tile, out, n_flat, a_div, act,
          row_step, up_off, alpha, limit) -> torch.Tensor:
    E, rows_w, K = w.shape
    N = out.shape[1]
    int4 = isinstance(w, Int4Experts)
    zeros, G, K_pad = None, 1, K
    if int4:
        check(scale is None, "int4 experts carry their own scales: pass no separate scale")
        scale, zeros, G, K_pad = w.checked_parts(a.device)
        w = w.qweight
    elif scale is None:
        check(w.dtype == a.dtype and w.device == a.device,
              f"the expert weights must be the activations' {a.dtype} on their device, got "
              f"{w.dtype} on {w.device}")
    else:
        check(w.dtype == torch.int8 and w.device == a.device,
              f"scaled expert weights must be int8 on the activations' device, got {w.dtype}")
        check(scale.shape == w.shape[:2] and scale.dtype == torch.float32
              and scale.device == a.device,
              f"the scales must be fp32 [{E}, {w.shape[1]}] (one per expert and output row)")
    check(out.dim() == 2 and out.shape[0] == n_flat and out.dtype in FLOATS
          and out.device == a.device, f"out must be a float [{n_flat}, {N}]")
    if bias is not None:
        check(bias.shape == (E, w.shape[1]) and bias.dtype in FLOATS and bias.device == a.device,
              f"bias must be a float [{E}, {w.shape[1]}]")
    if n_flat == 0:
        return out
    block_m = _block_m(sorted_ids, expert_of_tile, a.device)
    bn, bk = _gemm_tiles(N, K, a.dtype, act != 0)
    bk = min(bk, G) if int4 else bk  # (int4: each K step inside one group)
    b = a if bias is None else bias
    sc = a if scale is None else scale
    launch(_moe_gemm_kernel, (expert_of_tile.numel(), cdiv(N, bn)),
           a, w, sc, sc if zeros is None else zeros, b, a if rw is None else rw, sorted_ids,
           expert_of_tile, out, n_flat, N, K, K_pad, E, a_div, up_off, alpha, limit,
           a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
           sc.stride(0), sc.stride(1), sc.stride(2) if int4 else 0, b.stride(0), b.stride(1),
           out.stride(0), out.stride(1),
           ACT=act, ROW_STEP=row_step, W_QUANT=2 if int4 else int(scale is not None),
           GROUP=G, HAS_BIAS=bias is not None, MUL_WEIGHT=rw is not None,
           BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=dot_precision(a.dtype),
           num_warps=4)
    return out


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor,
                expert_of_tile: torch.Tensor, top_k: int, activation: str = "silu",
                bias: torch.Tensor | None = None, *, swiglu_alpha: float = 1.702,
                swiglu_limit: float = 7.0, scale: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, D], w13: [E, 2F, D] (x's dtype, or int8 with ``scale`` [E, 2F] fp32), bias:
    [E, 2F] -> h: [T*k, F] in x's dtype,
    h[f] = act(gate, up) of x[f // k] through expert e_f (module docstring; swiglu_oai reads
    gate / up interleaved and takes alpha / limit). Rows of h are flat ids t*k + j."""
    check(activation in ACTIVATIONS, f"activation must be one of {tuple(ACTIVATIONS)}, "
          f"got {activation!r}")
    check(x.dim() == 2 and x.dtype in FLOATS, "x must be a float [T, D]")
    shape = tuple(w13.shape)
    check(len(shape) == 3 and shape[1] % 2 == 0 and shape[2] == x.shape[1],
          f"w13 must be [E, 2F, {x.shape[1]}], got {list(shape)}")
    check(1 <= top_k <= MAX_TOP_K, f"top_k must be in [1, {MAX_TOP_K}]")
    T, F = x.shape[0], shape[1] // 2
    if out is None:
        out = empty((T, top_k, F), x.dtype, x.device).view(T * top_k, F)
    check(out.shape == (T * top_k, F), f"out must be [{T * top_k}, {F}]")
    interleaved = activation == "swiglu_oai"
    return _gemm(x, w13, scale, bias, None, sorted_ids, expert_of_tile, out, T * top_k, top_k,
                 ACTIVATIONS[activation], 2 if interleaved else 1, 1 if interleaved else F,
                 swiglu_alpha, swiglu_limit)


def moe_down(h: torch.Tensor, w2: torch.Tensor, sorted_ids: torch.Tensor,
             expert_of_tile: torch.Tensor, weights: torch.Tensor,
             bias: torch.Tensor | None = None, *, scale: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """h: [T*k, F], w2: [E, D, F] (h's dtype, or int8 with ``scale`` [E, D] fp32), weights:
    [T, k] fp32, bias: [E, D] ->
    y: [T*k, D] in h's dtype, y[f] = weights[f] * (h[f] @ w2[e_f].T + bias[e_f])."""
    check(weights.dim() == 2 and weights.dtype == torch.float32 and weights.is_contiguous(),
          "weights must be a contiguous fp32 [T, k]")
    n_flat = weights.numel()
    check(h.dim() == 2 and h.shape[0] == n_flat and h.dtype in FLOATS,
          f"h must be a float [{n_flat}, F] (T*k rows)")
    shape = tuple(w2.shape)
    check(len(shape) == 3 and shape[2] == h.shape[1],
          f"w2 must be [E, D, {h.shape[1]}], got {list(shape)}")
    check(weights.device == h.device, "weights must be on h's device")
    D = shape[1]
    if out is None:
        out = empty((weights.shape[0], weights.shape[1], D), h.dtype, h.device).view(n_flat, D)
    check(out.shape == (n_flat, D), f"out must be [{n_flat}, {D}]")
    return _gemm(h, w2, scale, bias, weights, sorted_ids, expert_of_tile, out, n_flat, 1, 0, 1, 0,
                 0.0, 0.0)


# ---------------------------------------------------------------------------------- combine

@triton.jit
def _moe_combine_kernel(y_ptr, out_ptr, shared_ptr, gate_ptr, T, D, stride_yf, stride_ot,
                        stride_st, stride_gt, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    ptrs = y_ptr + (offs_t * TOP_K)[:, None] * stride_yf + offs_d[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):  # j order, no atomics: the same sum in every batch
        acc += tl.load(ptrs + j * stride_yf, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:  # + sigmoid(gate[t]) * shared[t] (Qwen2-MoE's shared expert)
        g = tl.load(gate_ptr + offs_t * stride_gt, mask=offs_t < T, other=0.0).to(tl.float32)
        s = tl.load(shared_ptr + offs_t[:, None] * stride_st + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        acc += (1.0 / (1.0 + tl.exp(-g)))[:, None] * s
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(y: torch.Tensor, top_k: int, *, out: torch.Tensor | None = None,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None
                ) -> torch.Tensor:
    """y: [T*k, D] -> out: [T, D] (y's dtype), out[t] = y[t*k] + ... + y[t*k + k-1] in fp32;
    with ``shared`` [T, D] and ``shared_gate`` [T, 1] (logits), + sigmoid(gate[t]) * shared[t]."""
    check(1 <= top_k <= MAX_TOP_K, f"top_k must be in [1, {MAX_TOP_K}]")
    check(y.dim() == 2 and y.shape[0] % top_k == 0 and y.stride(1) == 1 and y.dtype in FLOATS,
          f"y must be a float [T*{top_k}, D] with unit column stride")
    T, D = y.shape[0] // top_k, y.shape[1]
    if out is None:
        out = empty((T, D), y.dtype, y.device)
    check(out.shape == (T, D) and out.stride(1) == 1 and out.device == y.device,
          f"out must be [{T}, {D}] with unit column stride")
    if T == 0:
        return out
    block_t = min(64, next_pow2(T)) if INTERPRET else 1
    block_d = min(next_pow2(D), 16384 if INTERPRET else 1024)
    has_shared = shared is not None
    if has_shared:
        check(shared.shape == (T, D) and shared.stride(1) == 1 and shared_gate is not None
              and shared_gate.shape == (T, 1), f"shared must be [{T}, {D}] with a [{T}, 1] gate")
    launch(_moe_combine_kernel, (cdiv(T, block_t), cdiv(D, block_d)), y, out,
           shared if has_shared else y, shared_gate if has_shared else y, T, D,
           y.stride(0), out.stride(0), shared.stride(0) if has_shared else 0,
           shared_gate.stride(0) if has_shared else 0, TOP_K=top_k, HAS_SHARED=has_shared,
           BLOCK_T=block_t, BLOCK_D=block_d)
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, *, softmax_first: bool, renormalize: bool,
              activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702,
              swiglu_limit: float = 7.0, block_m: int | None = None,
              shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, rows: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x: [T, D], router_logits: [T, E], w13: [E, 2F, D], w2: [E, D, F] (x's dtype, or int8
    with ``w13_scale`` [E, 2F] / ``w2_scale`` [E, D]), biases [E, 2F] / [E, D] -> out: [T, D]
    in x's dtype: route (counting each expert's rows into ``counts`` where given: moe_route),
    sort, gate/up, down, combine (module
    docstrings). ``block_m``: rows per expert tile, by default ``moe_block_m`` (per model; a
    caller's choice must not vary with T, or batch invariance goes). ``shared`` [T, D] and
    ``shared_gate`` [T, 1]: a shared expert's output and gate logits, added in the combine."""
    check(router_logits.dim() == 2 and router_logits.shape[0] == x.shape[0]
          and router_logits.shape[1] == w13.shape[0] == w2.shape[0],
          "router_logits must be [T, E] for x's T tokens and the weights' E experts")
    E = w13.shape[0]
    weights, ids = moe_route(router_logits, top_k, softmax_first=softmax_first,
                             renormalize=renormalize, counts=counts, rows=rows)
    sorted_ids, expert_of_tile, _ = moe_align(ids, E, block_m or moe_block_m(E, x.dtype))
    h = moe_gate_up(x, w13, sorted_ids, expert_of_tile, top_k, activation, w13_bias,
                    swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, scale=w13_scale)
    y = moe_down(h, w2, sorted_ids, expert_of_tile, weights, w2_bias, scale=w2_scale)
    return moe_combine(y, top_k, shared=shared, shared_gate=shared_gate)
