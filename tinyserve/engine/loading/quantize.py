"""Weight-only quantization of a float checkpoint at load time: int8 per output channel, int4
group-wise with zero points (``--quantization``)."""

from __future__ import annotations

import torch

from tinyserve.engine.model.weights import Int4Linear, Linear


def quantize_int8(w: torch.Tensor) -> Linear:
    """Symmetric per-output-channel int8: w ~= w_q * scale[:, None], |w_q| <= 127."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    w_q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)
    return Linear(w_q.contiguous(), scale.contiguous())


def quantize_experts_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] float -> (codes [E, N, K] int8, scales [E, N] fp32): each
    expert's rows as ``quantize_int8`` does a linear's (kernels/moe.py's int8 layout)."""
    E, N, K = w.shape
    lin = quantize_int8(w.reshape(E * N, K))  # (rows are independent: the stack is one matrix)
    return lin.weight.view(E, N, K), lin.scale.view(E, N)


# Zero points and a 20-step clip search: on stories260k the best of the four options measured
# (README, Results: quantization; round to nearest 88.5-90.4%, this 92.3% agreement with fp32
# over the reference text). A zero point spends all 16 codes on the group's range; the search
# trades the rare large weights' error for a finer step everywhere else.
INT4_GROUP_SIZE = 128
INT4_SYMMETRIC = False
INT4_CLIP_SEARCH = 20


def quantize_int4_linear(w: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
    """w: [out, in] float -> Int4Linear, groups of INT4_GROUP_SIZE (the last may be partial).
    Scales in fp16 as GPTQ / AWQ store them (bf16's 8-bit mantissa would add up to 0.4% to
    every weight's error), fp32 when the model runs in fp32."""
    from tinyserve.kernels.int4_pack import quantize_int4  # (see repack: not at import)

    qweight, scales, zeros = quantize_int4(w, INT4_GROUP_SIZE, INT4_SYMMETRIC, INT4_CLIP_SEARCH)
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    return Int4Linear(qweight, scales.to(scale_dtype), zeros, INT4_GROUP_SIZE, w.shape[1])


def quantize_experts_int4(w: torch.Tensor, dtype: torch.dtype,
                          device: torch.device | str | None = None):
    """Stacked experts [E, N, K] float -> kernels.moe.Int4Experts on ``device`` (w's when
    None): every expert row in groups of INT4_GROUP_SIZE as ``quantize_int4_linear`` does a
    linear's (zero points, the clip search), scales fp16 (fp32 for an fp32 model). One expert
    at a time on the device: the clip search's temporaries are a few times an expert's size,
    never the stack's (gpt-oss-120b's 128 experts of 5760 x 2880 would need tens of GB)."""
    from tinyserve.kernels.int4_pack import quantize_int4
    from tinyserve.kernels.moe import Int4Experts

    E, N, K = w.shape
    device = w.device if device is None else device
    G = -(-K // INT4_GROUP_SIZE)
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    qweight = torch.empty(E, N, G * INT4_GROUP_SIZE // 8, dtype=torch.int32, device=device)
    scales = torch.empty(E, N, G, dtype=scale_dtype, device=device)
    zeros = torch.empty(E, N, G, dtype=torch.uint8, device=device)
    for e in range(E):
        q, s, z = quantize_int4(w[e].to(device), INT4_GROUP_SIZE, INT4_SYMMETRIC,
                                INT4_CLIP_SEARCH)
        qweight[e], scales[e] = q, s.to(scale_dtype)
        zeros[e] = 8 if z is None else z  # (symmetric: the codes' midpoint)
    return Int4Experts(qweight, scales, zeros, INT4_GROUP_SIZE, K)
