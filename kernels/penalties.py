"""Sparse logits processing before sampling: logit_bias, bans, repetition / frequency /
presence penalties (vLLM's semantics and order).

Per row r and listed token t (each t at most once per row):

    x = logits[r, t] + bias[r, t]                 (logit_bias; -inf bans: min_tokens, -100)
    if count[r, t] > 0 or in_prompt[r, t]:        (repetition_penalty, vLLM/CTRL: seen anywhere)
        x = x * (1 / rep[r])  if x > 0  else  x * rep[r]
    x = x - freq[r] * count[r, t] - pres[r] * (count[r, t] > 0)    (OpenAI: output tokens only)

Tokens no row lists are untouched, so the work is O(listed tokens), not O(vocabulary): a
row lists the distinct tokens of its output, of its prompt (only with a repetition penalty),
its logit_bias keys and its banned ids; the host builds the lists (runner), deduplicated.
Layouts: logits [B, V] fp32 (updated in place); tokens [B, L] int32 (-1: padding);
counts [B, L] int32; in_prompt [B, L] int32 (0/1); bias [B, L] fp32; rep, freq, pres [B] fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.utils import INTERPRET, cdiv, check, launch

BLOCK_L_GPU, BLOCK_L_INTERPRET = 256, 1024


@triton.jit(do_not_specialize=["stride_tb", "L"])  # L varies every step: one compile
def _penalties_kernel(
    logits_ptr, tokens_ptr, counts_ptr, in_prompt_ptr, bias_ptr, rep_ptr, freq_ptr, pres_ptr,
    stride_lb, stride_tb, L, V,
    BLOCK_L: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    entry = row * stride_tb + offs
    tok = tl.load(tokens_ptr + entry, mask=offs < L, other=-1).to(tl.int64)
    ok = (tok >= 0) & (tok < V)  # (the engine checks ids; a stray one must not hit a neighbour)
    count = tl.load(counts_ptr + entry, mask=ok, other=0).to(tl.float32)
    seen = (count > 0) | (tl.load(in_prompt_ptr + entry, mask=ok, other=0) != 0)
    bias = tl.load(bias_ptr + entry, mask=ok, other=0.0)
    rep = tl.load(rep_ptr + row)
    ptrs = logits_ptr + row * stride_lb + tl.where(ok, tok, 0)
    x = tl.load(ptrs, mask=ok, other=0.0) + bias
    x = tl.where(seen, tl.where(x > 0, x * (1.0 / rep), x * rep), x)
    x = x - tl.load(freq_ptr + row) * count - tl.load(pres_ptr + row) * (count > 0).to(tl.float32)
    tl.store(ptrs, x, mask=ok)


def apply_penalties(logits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor, bias: torch.Tensor, rep: torch.Tensor,
                    freq: torch.Tensor, pres: torch.Tensor) -> None:
    """Update logits [B, V] in place for the listed tokens [B, L] (see the module docstring)."""
    check(logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1,
          "logits must be [B, V] float32 with unit column stride")
    B, V = logits.shape
    check(tokens.dim() == 2 and tokens.shape[0] == B and tokens.dtype == torch.int32
          and tokens.stride(1) == 1, f"tokens must be [{B}, L] int32")
    L = tokens.shape[1]
    for name, t, dt in (("counts", counts, torch.int32), ("in_prompt", in_prompt, torch.int32),
                        ("bias", bias, torch.float32)):
        check(t.shape == tokens.shape and t.dtype == dt and t.stride() == tokens.stride(),
              f"{name} must be [{B}, {L}] {dt}, laid out like tokens")
    for name, t in (("rep", rep), ("freq", freq), ("pres", pres)):
        check(t.shape == (B,) and t.dtype == torch.float32, f"{name} must be [{B}] float32")
    if B == 0 or L == 0:
        return
    block_l = BLOCK_L_INTERPRET if INTERPRET else BLOCK_L_GPU  # fixed: no compile per length
    launch(_penalties_kernel, (B, cdiv(L, block_l)),
           logits, tokens, counts, in_prompt, bias, rep, freq, pres,
           logits.stride(0), tokens.stride(0), L, V, BLOCK_L=block_l, num_warps=4)
