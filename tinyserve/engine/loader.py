"""Load a Hugging Face Llama checkpoint: config, safetensors weights, optional int8 / int4.

Weights are fused at load time for fewer launches: q/k/v into one [(Hq + 2Hk) * Dh, D]
projection and gate/up into one [2I, D] projection. Quantization is weight-only, for every
linear layer except the embedding and the LM head: int8 symmetric per output channel, or int4
in groups of 128 along K (``quantize_int4``), or a GPTQ / AWQ 4-bit checkpoint's own codes
repacked into the same int4 layout (quantized_checkpoints.py).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyserve.engine.quantized_checkpoints import (
    QuantFormat,
    check_g_idx,
    parse_quantization_config,
    repack,
    tensor_shapes,
)

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ModelLoadError(Exception):
    """A model directory that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    if not path.exists():
        raise ModelLoadError(f"{path}: missing (expected a Hugging Face config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    archs = raw.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") != "llama":
        raise ModelLoadError(f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"tinyserve serves {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: attention_bias/mlp_bias are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        # transformers 5 writes rope settings as one `rope_parameters` block; older checkpoints
        # use top-level rope_theta / rope_scaling.
        rope_params = raw.get("rope_parameters") or {}
        theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or (rope_params if rope_params else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        cfg = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_ids(gen.get("eos_token_id", raw.get("eos_token_id"))),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: required field {e.args[0]!r} is missing") from e
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {cfg.num_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_kv_heads}")
    if cfg.head_dim % 2:
        raise ModelLoadError(f"{path}: head_dim {cfg.head_dim} must be even for rotary embeddings")
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] not in ("llama3", "linear"):
        raise ModelLoadError(f"{path}: rope_scaling type {cfg.rope_scaling['rope_type']!r} is not "
                             "supported (default, linear, llama3)")
    return cfg


# ---------------------------------------------------------------------------------------------
# Rotary tables
# ---------------------------------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / float(s["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim / 2] fp32, computed as transformers does (fp32 products)."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    return freqs.cos().contiguous().to(device), freqs.sin().contiguous().to(device)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Linear:
    weight: torch.Tensor  # [out, in], float or int8
    scale: torch.Tensor | None = None  # [out] fp32 when weight is int8

    @property
    def numel(self) -> int:
        return self.weight.numel()

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


@dataclass(slots=True)
class Int4Linear:
    """int4_matmul's layout (kernels/int4_matmul.py): W[n, k] = (q[n, k] - zeros[n, g]) *
    scales[n, g], g = k // group_size, in_features padded to whole groups."""

    qweight: torch.Tensor  # [out, in_pad / 8] int32, 8 codes a word along in
    scales: torch.Tensor  # [out, in_pad / group_size] float
    zeros: torch.Tensor | None  # [out, in_pad / group_size] uint8; None: 8 (symmetric)
    group_size: int
    in_features: int

    @property
    def numel(self) -> int:
        return self.qweight.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.zeros) if t is not None)


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: Linear | Int4Linear  # [(Hq + 2 Hk) * Dh, D]
    o: Linear | Int4Linear  # [D, Hq * Dh]
    post_norm: torch.Tensor  # [D]
    gate_up: Linear | Int4Linear  # [2I, D]
    down: Linear | Int4Linear  # [D, I]


@dataclass(slots=True)
class LlamaWeights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: Linear  # [V, D], the embedding itself when tied
    quantization: str | None = None  # how the linear layers are stored: int8, int4, gptq, awq

    def nbytes(self, as_float: torch.dtype | None = None) -> int:
        """Bytes of all weights; with ``as_float``, as if no linear layer were quantized."""
        def lin_bytes(lin: Linear | Int4Linear) -> int:
            return lin.numel * as_float.itemsize if as_float else lin.nbytes

        total = sum(t.numel() * t.element_size() for t in (self.embed, self.norm))
        if self.lm_head.weight is not self.embed:
            total += lin_bytes(self.lm_head)
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_norm))
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
    from tinyserve.kernels.int4_matmul import quantize_int4  # (see repack: not at import)

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
                 device: torch.device | str, quantization: str | None = None) -> LlamaWeights:
    """``quantization``: None, "int8" or "int4" for a float checkpoint; a GPTQ / AWQ checkpoint
    loads as int4 by itself (``LlamaWeights.quantization`` says which)."""
    if quantization not in (None, "int8", "int4"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported (None, 'int8', 'int4')")
    fmt = _checkpoint_format(Path(model_dir))
    if fmt is not None and quantization is not None:
        raise ModelLoadError(f"{model_dir}: already quantized ({fmt.method}, 4-bit); serve it "
                             f"without quantization={quantization!r}")
    reader = _TensorReader(_weight_files(Path(model_dir)))
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def dense(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def linear(k: int, *parts: tuple[str, int]) -> Linear | Int4Linear:
        """parts: (name prefix, out_features), fused along out in this order; k: in_features."""
        if fmt is not None:
            lin = _checkpoint_int4(reader, fmt, parts, k)
        else:
            w = torch.cat([reader.get(f"{p}.weight", (n, k)) for p, n in parts])
            if quantization == "int4":  # (on the device: the clip search is 20 passes)
                lin = quantize_int4_linear(w.to(device), dtype)
            else:
                lin = quantize_int8(w) if quantization == "int8" else Linear(w.to(dtype))
        if isinstance(lin, Int4Linear):
            return Int4Linear(lin.qweight.to(device), lin.scales.to(device),
                              None if lin.zeros is None else lin.zeros.to(device),
                              lin.group_size, lin.in_features)
        return Linear(lin.weight.to(device).contiguous(),
                      None if lin.scale is None else lin.scale.to(device))

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            input_norm=dense(reader.get(p + "input_layernorm.weight", (D,))),
            qkv=linear(D, (p + "self_attn.q_proj", q_out), (p + "self_attn.k_proj", kv_out),
                       (p + "self_attn.v_proj", kv_out)),
            o=linear(q_out, (p + "self_attn.o_proj", D)),
            post_norm=dense(reader.get(p + "post_attention_layernorm.weight", (D,))),
            gate_up=linear(D, (p + "mlp.gate_proj", I), (p + "mlp.up_proj", I)),
            down=linear(I, (p + "mlp.down_proj", D)),
        ))
    embed = dense(reader.get("model.embed_tokens.weight", (V, D)))
    if "lm_head.qweight" in reader.files:  # (else it would fall back to the embedding)
        raise ModelLoadError(f"{model_dir}: a quantized LM head (lm_head.qweight) is not "
                             "supported: int4 covers the decoder's linear layers only")
    if cfg.tie_word_embeddings or "lm_head.weight" not in reader.files:
        if not cfg.tie_word_embeddings:
            log.warning("lm_head.weight is missing; using the tied embedding")
        lm_head = Linear(embed)
    else:
        lm_head = Linear(dense(reader.get("lm_head.weight", (V, D))))
    return LlamaWeights(embed=embed, layers=layers,
                        norm=dense(reader.get("model.norm.weight", (D,))), lm_head=lm_head,
                        quantization=fmt.method if fmt is not None else quantization)


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
