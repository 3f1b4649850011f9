"""The model's weights as the kernels hold them: one layer layout for every family, each
linear layer float, int8 per output channel, or int4 / int8 group-wise (a GGUF's codes kept
exactly). The loaders (loading/) build these; the model (decoder.py) reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tinyserve.kernels.moe import Int4Experts


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor  # [out, in], float or int8
    scale: torch.Tensor | None = None  # [out] fp32 when weight is int8
    bias: torch.Tensor | None = None  # [out], the model dtype

    @property
    def numel(self) -> int:
        return self.weight.numel()

    @property
    def nbytes(self) -> int:
        return _bytes(self.weight, self.scale, self.bias)


@dataclass(slots=True)
class Int4Linear:
    """int4_matmul's layout (kernels/group_matmul.py): W[n, k] = (q[n, k] - zeros[n, g]) *
    scales[n, g], or q[n, k] * scales[n, g] + mins[n, g] (GGUF's Q4_1 / Q4_K), g = k //
    group_size, in_features padded to whole groups."""

    qweight: torch.Tensor  # [out, in_pad / 8] int32, 8 codes a word along in
    scales: torch.Tensor  # [out, in_pad / group_size] float
    zeros: torch.Tensor | None  # [out, in_pad / group_size] uint8; None: 8 (symmetric)
    group_size: int
    in_features: int
    bias: torch.Tensor | None = None  # [out], the model dtype
    mins: torch.Tensor | None = None  # [out, in_pad / group_size] float, instead of zeros

    @property
    def numel(self) -> int:
        return self.qweight.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return _bytes(self.qweight, self.scales, self.zeros, self.mins, self.bias)


@dataclass(slots=True)
class Int8GroupLinear:
    """int8_group_matmul's layout (kernels/group_matmul.py): W[n, k] = codes[n, k] *
    scales[n, g] (+ mins[n, g]): GGUF's Q8_0, Q5_0 / Q5_1 / Q5_K and Q6_K, whose codes fit a
    byte, kept exactly."""

    codes: torch.Tensor  # [out, in_pad] int8
    scales: torch.Tensor  # [out, in_pad / group_size] float
    mins: torch.Tensor | None
    group_size: int
    in_features: int
    bias: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.codes.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return _bytes(self.codes, self.scales, self.mins, self.bias)


AnyLinear = Linear | Int4Linear | Int8GroupLinear


def _linear_bytes(lin: AnyLinear, as_float: torch.dtype | None = None) -> int:
    """A linear's bytes as stored; with ``as_float``, as if its weight were that float."""
    return lin.numel * as_float.itemsize + _bytes(lin.bias) if as_float else lin.nbytes


@dataclass(slots=True)
class ExpertWeights:
    """A sparse feed-forward (kernels/moe.py's layout): the router and every expert stacked."""

    router: Linear  # [E, D] float
    w13: torch.Tensor | Int4Experts  # [E, 2F, D]: each expert's gate rows, then its up rows
    w2: torch.Tensor | Int4Experts  # [E, D, F] (Int4Experts: --quantization int4)
    # Qwen2-MoE's shared expert: a dense MLP for every token, scaled by sigmoid(x shared_gate)
    shared_gate_up: AnyLinear | None = None  # [2S, D]
    shared_down: AnyLinear | None = None  # [D, S]
    shared_gate: Linear | None = None  # [1, D]
    # int8 experts (--quantization int8): w13 / w2 hold codes, one fp32 scale per expert row
    w13_scale: torch.Tensor | None = None  # [E, 2F]
    w2_scale: torch.Tensor | None = None  # [E, D]
    # gpt-oss: each expert's biases (w13's row layout: gate / up interleaved)
    w13_bias: torch.Tensor | None = None  # [E, 2F]
    w2_bias: torch.Tensor | None = None  # [E, D]

    def nbytes(self, as_float: torch.dtype | None = None) -> int:
        """Bytes of the router and experts; with ``as_float``, as if the experts were float."""
        shared = sum(_linear_bytes(lin, as_float) for lin in (
            self.shared_gate_up, self.shared_down, self.shared_gate) if lin is not None)
        fixed = shared + _bytes(self.router.weight, self.router.bias, self.w13_bias,
                                self.w2_bias)
        experts = (self.w13, self.w2)
        if as_float is not None:
            return fixed + sum(math.prod(w.shape) for w in experts) * as_float.itemsize
        return fixed + _bytes(self.w13_scale, self.w2_scale) + sum(
            _bytes(w.qweight, w.scales, w.zeros) if isinstance(w, Int4Experts) else _bytes(w)
            for w in experts)


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: AnyLinear  # [(Hq + 2 Hk) * Dh, D]
    o: AnyLinear  # [D, Hq * Dh]
    post_norm: torch.Tensor  # [D]: before the MLP; with sandwich norms, after attention
    gate_up: AnyLinear | None  # [2I, D] (None: a sparse layer)
    down: AnyLinear | None  # [D, I]
    pre_ffn_norm: torch.Tensor | None = None  # [D] (sandwich norms: Gemma)
    post_ffn_norm: torch.Tensor | None = None  # [D] (sandwich norms: Gemma)
    q_norm: torch.Tensor | None = None  # [Dh] (Qwen3, Gemma 3); [Hq * Dh] (OLMoE)
    k_norm: torch.Tensor | None = None  # [Dh]; [Hk * Dh]
    experts: ExpertWeights | None = None  # a sparse feed-forward instead of gate_up / down
    sinks: torch.Tensor | None = None  # [Hq] fp32: attention sink logits (gpt-oss)

    @property
    def norms(self) -> tuple[torch.Tensor | None, ...]:
        return (self.input_norm, self.post_norm, self.pre_ffn_norm, self.post_ffn_norm,
                self.q_norm, self.k_norm)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: AnyLinear  # [V, D], the embedding itself when tied (or its GGUF codes)
    # how the linear layers are stored: int8, int4, gptq, awq, gguf
    quantization: str | None = None

    def nbytes(self, as_float: torch.dtype | None = None) -> int:
        """Bytes of all weights; with ``as_float``, as if no linear layer were quantized."""
        total = _bytes(self.embed, self.norm)
        if getattr(self.lm_head, "weight", None) is not self.embed:
            total += _linear_bytes(self.lm_head, as_float)
        for layer in self.layers:
            total += _bytes(*layer.norms, layer.sinks)
            total += sum(_linear_bytes(x, as_float) for x in (layer.qkv, layer.o, layer.gate_up,
                                                                layer.down)
                         if x is not None)
            if layer.experts is not None:
                total += layer.experts.nbytes(as_float)
        return total
