"""Host-side int4 packing for group_matmul.int4_matmul (plain torch): the loaders that repack
GPTQ / AWQ / GGUF codes, --quantization int4, and the tests' references.

    qweight [N, K_pad // 8] int32, 8 codes a word along K, low nibble first (group_matmul.py)
"""

from __future__ import annotations

import torch

from tinyserve.kernels.utils import cdiv, check


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integer codes in [0, 15] -> [N, K // 8] int32, low nibble first along K."""
    check(q.dim() == 2 and q.shape[1] % 8 == 0, f"q must be [N, K] with K % 8 == 0, got {list(q.shape)}")
    shifts = torch.arange(0, 32, 4, device=q.device)  # nibble j at bits 4j .. 4j+3
    words = (q.to(torch.int64).reshape(q.shape[0], -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K // 8] int32 -> q: [N, K] int32 codes in [0, 15]."""
    q = (qweight[:, :, None] >> torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)) & 0xF
    return q.reshape(qweight.shape[0], -1)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                  clip_search: int = 0,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w: [N, K] float -> (qweight [N, K_pad // 8] int32, scales [N, K_pad // G] fp32,
    zeros [N, K_pad // G] uint8 or None), K_pad = ceil(K / G) * G; round to nearest.

    symmetric: scale = 2 * max|w| / 15 and q = clamp(round(w / s) + 8, 0, 15) (GPTQ's choice: the
    top value max|w| / s = 7.5 clips to 7, still within s / 2). Asymmetric: the group's
    [min(w, 0), max(w, 0)] spans 15 steps, zero = round(-min / s) in [0, 15] (with 0 in the
    range, as GPTQ's quantizer has it, a group of one sign does not clip). A partial last
    group takes its statistics from its real columns; its padding gets the zero-point code.

    clip_search > 0: also try the range shrunk by 1 - i / (clip_search / 0.8) for i <
    clip_search (down to 0.2 of it) and keep, per group, the one with the least squared
    error (GPTQ's ``mse`` option; round-to-nearest otherwise): clipping the rare large weights
    buys a finer step for all the others. Without it, |w - dequantized| <= scale / 2."""
    check(w.dim() == 2 and w.dtype.is_floating_point, "w must be a float [N, K]")
    N, K = w.shape
    check(group_size > 0 and group_size % 16 == 0,
          f"group_size must be a positive multiple of 16 (as int4_matmul needs), got {group_size}")
    groups = cdiv(K, group_size)
    wf = w.float()
    if groups * group_size > K:  # pad with copies of the last column: min, max and max|w| stay
        wf = torch.cat([wf, wf[:, -1:].expand(N, groups * group_size - K)], dim=1)
    wg = wf.view(N, groups, group_size)
    real = (torch.arange(groups * group_size, device=w.device) < K).view(1, groups, group_size)

    def params(shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
        if symmetric:
            s = (wg.abs().amax(-1) * (2 / 15) * shrink).clamp(min=1e-10)
            return s, torch.full_like(s, 8.0)
        lo, hi = wg.amin(-1).clamp(max=0) * shrink, wg.amax(-1).clamp(min=0) * shrink
        s = ((hi - lo) / 15).clamp(min=1e-10)
        return s, torch.round(-lo / s).clamp(0, 15)

    def codes(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)

    scales, zp = params(1.0)
    if clip_search > 0:
        def err(s, z):
            return (((codes(s, z) - z[..., None]) * s[..., None] - wg) ** 2 * real).sum(-1)

        best = err(scales, zp)
        for i in range(1, clip_search):
            s, z = params(1 - 0.8 * i / clip_search)
            e = err(s, z)
            better = e < best
            best = torch.where(better, e, best)
            scales, zp = torch.where(better, s, scales), torch.where(better, z, zp)
    q = codes(scales, zp).reshape(N, -1)
    q[:, K:] = zp[:, -1:]  # padding dequantizes to exactly 0
    return pack_int4(q.to(torch.int32)), scales, None if symmetric else zp.to(torch.uint8)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                    group_size: int = 128, k: int | None = None) -> torch.Tensor:
    """The fp32 W that ``int4_matmul`` multiplies by (reference; loaders, debugging):
    [N, k] given the real K, else [N, K_pad] with the padding."""
    q = unpack_int4(qweight).float()
    z = 8.0 if zeros is None else zeros.float().repeat_interleave(group_size, dim=1)
    return ((q - z) * scales.float().repeat_interleave(group_size, dim=1))[:, :k]
