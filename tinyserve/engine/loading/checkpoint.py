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
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyserve.engine.loading.model_config import ModelConfig, ModelLoadError
from tinyserve.engine.loading.mxfp4 import GROUP, dequantize_mxfp4
from tinyserve.engine.loading.quantize import (
    quantize_experts_int4,
    quantize_experts_int8,
    quantize_int4_linear,
    quantize_int8,
)
from tinyserve.engine.loading.quantized_checkpoints import (
    QuantFormat,
    check_g_idx,
    parse_quantization_config,
    repack,
    tensor_shapes,
)
from tinyserve.engine.model.weights import (
    ExpertWeights,
    Int4Linear,
    LayerWeights,
    Linear,
    ModelWeights,
)

log = logging.getLogger(__name__)

def _checkpoint_format(model_dir: Path) -> QuantFormat | None:
    path = model_dir / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot be read ({e})") from e
    if qc is None or qc.get("quant_method") == "mxfp4":  # (gpt-oss's experts: read by name)
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
    if cfg.num_experts and fmt is not None:
        raise ModelLoadError(f"{model_dir}: {fmt.method} experts are not supported yet; serve "
                             "the float weights (with quantization='int8' or 'int4' if need be)")
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
        sparse, whole = cfg.is_sparse(i), cfg.qk_norm_whole
        return LayerWeights(
            input_norm=self.dense(p + "input_layernorm.weight", (D,)),
            qkv=self.linear(D, qkv, cfg.qkv_bias),
            o=self.linear(q_out, ((p + "self_attn.o_proj", D),), cfg.o_bias),
            post_norm=self.dense(p + "post_attention_layernorm.weight", (D,)),
            gate_up=None if sparse else self.linear(D, gate_up, cfg.mlp_bias),
            down=None if sparse else self.linear(I, ((p + "mlp.down_proj", D),), cfg.mlp_bias),
            experts=self.experts(p) if sparse else None,
            pre_ffn_norm=self.dense(p + "pre_feedforward_layernorm.weight", (D,)) if sandwich else None,
            post_ffn_norm=self.dense(p + "post_feedforward_layernorm.weight", (D,)) if sandwich else None,
            q_norm=self.dense(p + "self_attn.q_norm.weight", (q_out if whole else Dh,))
            if cfg.qk_norm or whole else None,
            k_norm=self.dense(p + "self_attn.k_norm.weight", (kv_out if whole else Dh,))
            if cfg.qk_norm or whole else None,
            sinks=self.reader.get(p + "self_attn.sinks", (cfg.num_heads,)).to(
                device=self.device, dtype=torch.float32).contiguous() if cfg.attn_sinks else None)


    def experts(self, p: str) -> ExpertWeights:
        """A sparse layer's router and experts: stacked (transformers 5's gate_up_proj [E, 2F,
        D] and down_proj [E, D, F]) or one module per expert (Qwen's gate/up/down_proj,
        Mixtral's w1 (gate) / w3 (up) / w2 (down) under block_sparse_moe)."""
        cfg, files = self.cfg, self.reader.files
        E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        moe = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in files else "mlp.")
        if cfg.moe_biases:
            return self._gpt_oss_experts(moe)
        router = Linear(self.dense(moe + "gate.weight", (E, D)))
        shared = {}
        if cfg.shared_expert_size:
            S, se = cfg.shared_expert_size, moe + "shared_expert."
            shared = dict(shared_gate_up=self.linear(D, ((se + "gate_proj", S),
                                                         (se + "up_proj", S))),
                          shared_down=self.linear(S, ((se + "down_proj", D),)),
                          shared_gate=Linear(self.dense(moe + "shared_expert_gate.weight",
                                                        (1, D))))
        if moe + "experts.gate_up_proj" in files:
            w13 = self.reader.get(moe + "experts.gate_up_proj", (E, 2 * F, D))
            w2 = self.reader.get(moe + "experts.down_proj", (E, D, F))
        else:
            names = ("w1", "w3", "w2") if moe.endswith("block_sparse_moe.") else \
                ("gate_proj", "up_proj", "down_proj")
            gate, up, down = (f"{moe}experts.{{}}.{n}.weight" for n in names)
            w13 = torch.stack([torch.cat([self.reader.get(gate.format(e), (F, D)),
                                          self.reader.get(up.format(e), (F, D))])
                               for e in range(E)])
            w2 = torch.stack([self.reader.get(down.format(e), (D, F)) for e in range(E)])
        return self._stacked(router, w13, w2, **shared)

    def _gpt_oss_experts(self, moe: str) -> ExpertWeights:
        """gpt-oss: ``router`` with a bias; experts stacked as transformers holds them,
        transposed (gate_up_proj [E, D, 2F], gate and up interleaved; down_proj [E, F, D]),
        each with a bias."""
        cfg = self.cfg
        E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        router = Linear(self.dense(moe + "router.weight", (E, D)), None,
                        self.dense(moe + "router.bias", (E,)))
        x = moe + "experts."
        if x + "gate_up_proj_blocks" in self.reader.files:  # MXFP4 (gpt-oss's own checkpoints)
            w13, w2 = self._mxfp4(x + "gate_up_proj", E, 2 * F, D), self._mxfp4(x + "down_proj",
                                                                                E, D, F)
        else:
            w13 = self.reader.get(x + "gate_up_proj", (E, D, 2 * F)).transpose(1, 2)
            w2 = self.reader.get(x + "down_proj", (E, F, D)).transpose(1, 2)
        return self._stacked(router, w13, w2, w13_bias=self.dense(x + "gate_up_proj_bias",
                                                                   (E, 2 * F)),
                             w2_bias=self.dense(x + "down_proj_bias", (E, D)))

    def _mxfp4(self, name: str, E: int, N: int, K: int) -> torch.Tensor:
        """``name``_blocks / _scales -> [E, N, K] in the model's dtype (mxfp4.py)."""
        if K % GROUP:
            raise ModelLoadError(f"{name}_blocks: MXFP4 needs the input size ({K}) in groups "
                                 f"of {GROUP}")
        G = K // GROUP
        blocks = self.reader.get(name + "_blocks", (E, N, G, GROUP // 2))
        scales = self.reader.get(name + "_scales", (E, N, G))
        try:  # (in the model's dtype, exactly: half fp32's host memory for bf16)
            return dequantize_mxfp4(blocks, scales, self.reader.files[name + "_blocks"],
                                    self.dtype)
        except ValueError as e:
            raise ModelLoadError(f"{e} ({name})") from e

    def _stacked(self, router: Linear, w13: torch.Tensor, w2: torch.Tensor,
                 **rest) -> ExpertWeights:
        """w13 [E, 2F, D] and w2 [E, D, F] (host, any float dtype) on the device: the model's
        dtype, int8 codes and row scales (``--quantization int8``) or int4 group-wise
        (``--quantization int4``); the router stays float: it picks the experts."""
        dev = self.device
        if self.quantization == "int8":
            (q13, s13), (q2, s2) = quantize_experts_int8(w13), quantize_experts_int8(w2)
            return ExpertWeights(router, q13.to(dev), q2.to(dev), **rest,
                                 w13_scale=s13.to(dev), w2_scale=s2.to(dev))
        if self.quantization == "int4":  # (on the device: the clip search is 20 passes)
            return ExpertWeights(router, quantize_experts_int4(w13, self.dtype, dev),
                                 quantize_experts_int4(w2, self.dtype, dev), **rest)
        return ExpertWeights(router, w13.to(device=dev, dtype=self.dtype).contiguous(),
                             w2.to(device=dev, dtype=self.dtype).contiguous(), **rest)


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
