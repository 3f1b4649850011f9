"""gpt-oss's MXFP4 experts (OCP microscaling FP4, as its checkpoints store them): per expert and
output row, groups of 32 weights along the input, each an e2m1 code (4 bits: sign, 2 exponent
bits, 1 mantissa bit) times the group's e8m0 scale 2^(s - 127).

    <name>_blocks  [E, N, K / 32, 16] uint8   two codes a byte, the low nibble first
    <name>_scales  [E, N, K / 32]     uint8

Dequantized here at load, on the host, into kernels/moe.py's layout [E, N, K] (rows = outputs):
every value is exact in fp32 and in bf16 (a code has at most two significant bits), the same
as transformers' ``convert_moe_packed_tensors`` gives (transposed to its [E, K, N]). The fused
GEMM does not read the codes itself yet: MXFP4 experts are served as the model's dtype (or as
int8 with --quantization int8).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # weights per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, where: str,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, N, G, 16] uint8, scales [E, N, G] uint8 -> [E, N, G * 32] in ``dtype`` (fp32,
    bf16 or fp16: every value is exact in the first two; in fp16 those below 2^-24 flush);
    ValueError naming ``where`` for tensors of another shape or dtype, or weights that are not
    finite. One expert at a time: the temporaries are an expert's, not the stack's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} "
                         f"and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{where}: MXFP4 blocks {list(blocks.shape)} and scales "
                         f"{list(scales.shape)} must be [E, N, G, 16] and [E, N, G]")
    E, N, G = scales.shape
    lut = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(E, N, G * GROUP, dtype=dtype)
    for e in range(E):
        b = blocks[e]
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).int()  # [N, G, 16, 2]
        values = torch.ldexp(lut[codes].reshape(N, G, GROUP),
                             (scales[e].int() - 127)[..., None].float())
        out[e] = values.reshape(N, -1)
        # e8m0 255 is NaN; 2^127 x 6 overflows fp32 (and fp16 overflows far sooner)
        if not torch.isfinite(out[e]).all():
            raise ValueError(f"{where}: MXFP4 scales give non-finite {dtype} weights (a scale "
                             "of 255, which is NaN, or one too large for the codes)")
    return out
