"""Load a checkpoint's safetensors weights into one layer layout for every family, optionally
quantized (int8 / int4). The config side is model_config.py.

Weights are fused at load time for fewer launches: q/k/v into one [(Hq + 2Hk) * Dh, D]
projection and gate/up into one [2I, D] projection (Phi-3 ships them fused: qkv_proj,
gate_up_proj, gate first); biases are fused the same way. Quantization is weight-only, for
every linear layer except the embedding and the LM head: int8 symmetric per output channel, or
int4 in groups of 128 along K (``quantize_int4``), or a GPTQ / AWQ 4-bit checkpoint's own codes
repacked into the same int4 layout (quantized_checkpoints.py). Biases and norms stay float.

Weight names (``model.layers.{i}.`` prefix): input_layernorm, self_attn.{q,k,v,o}_proj (or
qkv_proj), self_attn.{q,k}_norm (Qwen3, Gemma 3), post_attention_layernorm,
pre_feedforward_layernorm and post_feedforward_layernorm (Gemma), mlp.{gate,up,down}_proj (or
gate_up_proj); model.embed_tokens, model.norm, lm_head (absent when tied).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyserve.engine.model_config import ModelConfig, ModelLoadError
from tinyserve.engine.quantized_checkpoints import (
    QuantFormat,
    check_g_idx,
    parse_quantization_config,
    repack,
    tensor_shapes,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

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


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: AnyLinear  # [(Hq + 2 Hk) * Dh, D]
    o: AnyLinear  # [D, Hq * Dh]
    post_norm: torch.Tensor  # [D]: before the MLP; with sandwich norms, after attention
    gate_up: AnyLinear  # [2I, D]
    down: AnyLinear  # [D, I]
    pre_ffn_norm: torch.Tensor | None = None  # [D] (sandwich norms: Gemma)
    post_ffn_norm: torch.Tensor | None = None  # [D] (sandwich norms: Gemma)
    q_norm: torch.Tensor | None = None  # [Dh] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [Dh]

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
        def lin_bytes(lin: AnyLinear) -> int:
            return lin.numel * as_float.itemsize + _bytes(lin.bias) if as_float else lin.nbytes

        total = _bytes(self.embed, self.norm)
        if getattr(self.lm_head, "weight", None) is not self.embed:
            total += lin_bytes(self.lm_head)
        for layer in self.layers:
            total += _bytes(*layer.norms)
            total += sum(lin_bytes(x) for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total


def quantize_int8(w: torch.Tensor) -> Linear:
    """Symmetric per-output-channel int8: w ~= w_q * scale[:, None], |w_q| <= 127."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    w_q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)
    return Linear(w_q.contiguous(), scale.contiguous())


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


def _checkpoint_format(model_dir: Path) -> QuantFormat | None:
    path = model_dir / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot be read ({e})") from e
    if qc is None:
        return None
    try:
        return parse_quantization_config(qc)
    except ValueError as e:
        raise ModelLoadError(f"{path}: quantization_config: {e}") from e


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """"gptq" or "awq" for a 4-bit checkpoint that loads as int4, None for a float one;
    ModelLoadError for a quantization_config that cannot be served."""
    fmt = _checkpoint_format(Path(model_dir))
    return None if fmt is None else fmt.method


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from model.safetensors or a sharded index."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


class _TensorReader:
    """Reads named tensors, checking shapes, with each file opened once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._handles: dict[Path, Any] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            where = next(iter(set(self.files.values())), "the checkpoint")
            raise ModelLoadError(f"{where}: tensor {name!r} is missing")
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        t = self._handles[path].get_tensor(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"config.json implies {shape}")
        return t


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, quantization: str | None = None) -> ModelWeights:
    """``quantization``: None, "int8" or "int4" for a float checkpoint; a GPTQ / AWQ checkpoint
    loads as int4 by itself (``ModelWeights.quantization`` says which)."""
    if quantization not in (None, "int8", "int4"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported (None, 'int8', 'int4')")
    fmt = _checkpoint_format(Path(model_dir))
    if fmt is not None and quantization is not None:
        raise ModelLoadError(f"{model_dir}: already quantized ({fmt.method}, 4-bit); serve it "
                             f"without quantization={quantization!r}")
    reader = _TensorReader(_weight_files(Path(model_dir)))
    layers = _Layers(reader, cfg, fmt, quantization, dtype, device)
    D, V = cfg.hidden_size, cfg.vocab_size
    embed = layers.dense("model.embed_tokens.weight", (V, D))
    if "lm_head.qweight" in reader.files:  # (else it would fall back to the embedding)
        raise ModelLoadError(f"{model_dir}: a quantized LM head (lm_head.qweight) is not "
                             "supported: int4 covers the decoder's linear layers only")
    if cfg.tie_word_embeddings or "lm_head.weight" not in reader.files:
        if not cfg.tie_word_embeddings:
            log.warning("lm_head.weight is missing; using the tied embedding")
        lm_head = Linear(embed)
    else:
        lm_head = Linear(layers.dense("lm_head.weight", (V, D)))
    return ModelWeights(embed=embed, layers=[layers.layer(i) for i in range(cfg.num_layers)],
                        norm=layers.dense("model.norm.weight", (D,)), lm_head=lm_head,
                        quantization=fmt.method if fmt is not None else quantization)


class _Layers:
    """One decoder layer's weights at a time, by the family's names (module docstring)."""

    def __init__(self, reader: _TensorReader, cfg: ModelConfig, fmt: QuantFormat | None,
                 quantization: str | None, dtype: torch.dtype, device: torch.device | str) -> None:
        self.reader, self.cfg, self.fmt, self.quantization = reader, cfg, fmt, quantization
        self.dtype, self.device = dtype, device

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.get(name, shape).to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, k: int, parts: tuple[tuple[str, int], ...], bias: bool = False
               ) -> Linear | Int4Linear:
        """parts: (name prefix, out_features), fused along out in this order; k: in_features;
        ``bias``: each part has one (fused the same way)."""
        dev = self.device
        if self.fmt is not None:
            lin = _checkpoint_int4(self.reader, self.fmt, parts, k)
        else:
            w = torch.cat([self.reader.get(f"{p}.weight", (n, k)) for p, n in parts])
            if self.quantization == "int4":  # (on the device: the clip search is 20 passes)
                lin = quantize_int4_linear(w.to(dev), self.dtype)
            elif self.quantization == "int8":
                lin = quantize_int8(w)
            else:
                lin = Linear(w.to(self.dtype))
        b = None
        if bias:
            b = torch.cat([self.reader.get(f"{p}.bias", (n,)) for p, n in parts])
            b = b.to(device=dev, dtype=self.dtype).contiguous()
        if isinstance(lin, Int4Linear):
            return Int4Linear(lin.qweight.to(dev), lin.scales.to(dev),
                              None if lin.zeros is None else lin.zeros.to(dev),
                              lin.group_size, lin.in_features, b)
        return Linear(lin.weight.to(dev).contiguous(),
                      None if lin.scale is None else lin.scale.to(dev), b)

    def layer(self, i: int) -> LayerWeights:
        cfg, p = self.cfg, f"model.layers.{i}."
        D, I, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * Dh, cfg.num_kv_heads * Dh
        if cfg.fused_checkpoint:  # Phi-3
            qkv = ((p + "self_attn.qkv_proj", q_out + 2 * kv_out),)
            gate_up = ((p + "mlp.gate_up_proj", 2 * I),)
        else:
            qkv = tuple((p + f"self_attn.{x}_proj", n)
                        for x, n in (("q", q_out), ("k", kv_out), ("v", kv_out)))
            gate_up = ((p + "mlp.gate_proj", I), (p + "mlp.up_proj", I))
        sandwich = cfg.sandwich_norms
        return LayerWeights(
            input_norm=self.dense(p + "input_layernorm.weight", (D,)),
            qkv=self.linear(D, qkv, cfg.qkv_bias),
            o=self.linear(q_out, ((p + "self_attn.o_proj", D),), cfg.o_bias),
            post_norm=self.dense(p + "post_attention_layernorm.weight", (D,)),
            gate_up=self.linear(D, gate_up, cfg.mlp_bias),
            down=self.linear(I, ((p + "mlp.down_proj", D),), cfg.mlp_bias),
            pre_ffn_norm=self.dense(p + "pre_feedforward_layernorm.weight", (D,)) if sandwich else None,
            post_ffn_norm=self.dense(p + "post_feedforward_layernorm.weight", (D,)) if sandwich else None,
            q_norm=self.dense(p + "self_attn.q_norm.weight", (Dh,)) if cfg.qk_norm else None,
            k_norm=self.dense(p + "self_attn.k_norm.weight", (Dh,)) if cfg.qk_norm else None)


def _checkpoint_int4(reader: _TensorReader, fmt: QuantFormat, parts: tuple[tuple[str, int], ...],
                     k: int) -> Int4Linear:
    """A GPTQ / AWQ layer (its parts fused along out) repacked on the host: groups run along
    in_features, so fused parts just stack their rows."""
    qweights, scales, zeros = [], [], []
    for prefix, n in parts:
        where = reader.files.get(f"{prefix}.qweight", "the checkpoint")
        try:
            tensors = {s: reader.get(f"{prefix}.{s}", shape)
                       for s, shape in tensor_shapes(fmt, n, k).items()}
            if fmt.method == "gptq" and f"{prefix}.g_idx" in reader.files:
                check_g_idx(reader.get(f"{prefix}.g_idx", (k,)), fmt.group_size)
            q, s, z = repack(fmt, tensors)
        except ValueError as e:
            raise ModelLoadError(f"{where}: {prefix}: {e}") from e
        qweights.append(q)
        scales.append(s)
        zeros.append(z)
    z = torch.cat(zeros)
    return Int4Linear(torch.cat(qweights), torch.cat(scales), None if bool((z == 8).all()) else z,
                      fmt.group_size, k)
