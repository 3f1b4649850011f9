"""A GGUF file's tensors -> ModelWeights, kept quantized (gguf_quants.py says how each type is
held), with llama.cpp's conversions undone:

    llama.cpp name                HF role                       undone here
    token_embd                    embed_tokens                  dequantized (a gather needs rows)
    output                        lm_head (absent: tied)        tied: the embedding's own codes
    blk.N.attn_norm               input_layernorm               Gemma: stored as 1 + w
    blk.N.attn_q / _k / _v        q / k / v_proj (+ .bias)      llama: rows permuted for its rope
    blk.N.attn_qkv                Phi-3's fused qkv_proj
    blk.N.attn_output             o_proj
    blk.N.attn_q_norm / _k_norm   q_norm / k_norm (Qwen3, Gemma 3)
    blk.N.ffn_norm                post_attention (Gemma: pre_feedforward) layernorm
    blk.N.post_attention_norm     Gemma's post_attention_layernorm
    blk.N.post_ffw_norm           Gemma's post_feedforward_layernorm
    blk.N.ffn_gate / _up / _down  gate / up / down_proj (Phi-3: ffn_up holds gate and up)
    output_norm                   norm

Tensors fused into one of our layers (q, k, v; gate, up) must share a form: where a file mixes
types across them (Q4_K_M puts some v and down projections in Q6_K) they are all held as int8
codes at the smallest group, which is exact for every type (an int4 code fits a byte, a group
of 32 is two of 16 with the same scale).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tinyserve.engine.loading.gguf_quants import Quantized, decode
from tinyserve.engine.loading.model_config import ModelConfig, ModelLoadError
from tinyserve.engine.model.weights import (
    AnyLinear,
    Int4Linear,
    Int8GroupLinear,
    LayerWeights,
    Linear,
    ModelWeights,
)
from tinyserve.formats.gguf import GGUFError, GGUFFile

log = logging.getLogger(__name__)


class _Reader:
    def __init__(self, f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, dequantize: bool) -> None:
        self.f, self.cfg, self.dtype, self.device = f, cfg, dtype, device
        self.dequantize = dequantize  # every linear layer as floats in dtype
        self.arch = f.architecture
        self.gemma = cfg.norm_unit_offset  # norms stored as 1 + w by llama.cpp
        self.mixed: set[str] = set()

    def rows(self, name: str, shape: tuple[int, ...]) -> np.ndarray | Quantized:
        t = self.f.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.f.path}: tensor {name} is missing")
        if t.shape != shape and not (len(shape) == 1 and t.shape == (1, *shape)):
            raise ModelLoadError(f"{self.f.path}: {name} has shape {list(t.shape)}, expected "
                                 f"{list(shape)}")
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        try:
            return decode(t.type_name, self.f.data(name), rows, cols)
        except ValueError as e:
            raise ModelLoadError(f"{self.f.path}: {name}: {e}") from e

    def vector(self, name: str, n: int, offset: float = 0.0) -> torch.Tensor:
        v = self.rows(name, (n,))
        v = v.dequantize() if isinstance(v, Quantized) else v
        return self._tensor(v.reshape(n) - offset)

    def norm(self, name: str, n: int) -> torch.Tensor:
        return self.vector(name, n, 1.0 if self.gemma else 0.0)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(
            device=self.device, dtype=self.dtype)

    def linear(self, names: list[tuple[str, int]], k: int, bias: bool = False,
               permute: list[int | None] | None = None) -> AnyLinear:
        """names: (tensor, rows), fused along rows in order; permute: each part's llama head
        count to un-permute its rows by (None: as stored)."""
        parts = [self.rows(n, (rows, k)) for n, rows in names]
        for i, heads in enumerate(permute or []):
            if heads:
                parts[i] = _unpermute(parts[i], heads)
        b = None
        if bias:
            b = self._tensor(np.concatenate([self.vector(f"{n.removesuffix('.weight')}.bias",
                                                         rows).cpu().float().numpy()
                                             for n, rows in names]))
        return self._fuse(parts, k, b, names[0][0])

    def _fuse(self, parts: list, k: int, bias: torch.Tensor | None, name: str) -> AnyLinear:
        quantized = [p for p in parts if isinstance(p, Quantized)]
        if len(quantized) < len(parts) or self.dequantize:  # a float part: all of it float
            if quantized and not self.dequantize:
                log.info("%s: fused with float parts, held dequantized", name)
            w = np.concatenate([p.dequantize() if isinstance(p, Quantized) else p for p in parts])
            return Linear(self._tensor(w), bias=bias)
        bits = {p.bits for p in parts}
        groups = {p.group for p in parts}
        with_mins = {p.mins is not None for p in parts}
        if bits == {4} and len(groups) == 1 and len(with_mins) == 1:
            return self._int4(parts, k, bias)
        self.mixed.add(name)
        return self._int8(parts, k, bias, min(groups), any(with_mins))

    def _int4(self, parts: list[Quantized], k: int, bias: torch.Tensor | None) -> Int4Linear:
        codes = np.concatenate([p.codes for p in parts])
        scales = _cat_groups([p.scales for p in parts])
        mins = None if parts[0].mins is None else _cat_groups([p.mins for p in parts])
        return Int4Linear(self._put(_pack_int4(codes)), self._put(scales), None, parts[0].group,
                          k, bias, None if mins is None else self._put(mins))

    def _int8(self, parts: list[Quantized], k: int, bias: torch.Tensor | None, group: int,
              with_mins: bool) -> Int8GroupLinear:
        codes, scales, mins = [], [], []
        for p in parts:
            c = p.codes.astype(np.int8)
            m = p.mins
            if p.bits == 4 and m is None:  # symmetric int4: (q - 8) * s
                c = (p.codes.astype(np.int16) - 8).astype(np.int8)
            reps = p.group // group
            codes.append(c)
            scales.append(np.repeat(p.scales, reps, axis=1))
            if with_mins:
                mins.append(np.repeat(np.zeros_like(p.scales) if m is None else m, reps, axis=1))
        return Int8GroupLinear(self._put(np.concatenate(codes)), self._put(_cat_groups(scales)),
                               self._put(_cat_groups(mins)) if with_mins else None, group, k,
                               bias)

    def _put(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)


def _cat_groups(arrays: list[np.ndarray]) -> np.ndarray:
    """Scales of fused parts: one dtype (fp16 stays fp16 when all are)."""
    dtype = np.float16 if all(a.dtype == np.float16 for a in arrays) else np.float32
    return np.concatenate([a.astype(dtype) for a in arrays])


def _pack_int4(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes in [0, 15] -> [N, K / 8] int32, 8 a word along K, low nibble first."""
    n, k = codes.shape
    nib = codes.reshape(n, k // 8, 8).astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(nib, axis=-1).view(np.int32)


def _unpermute(part: np.ndarray | Quantized, heads: int) -> np.ndarray | Quantized:
    """llama.cpp reorders q / k rows within each head for its rope (pairs interleaved); put
    them back in Hugging Face's order (halves). Rows are whole blocks: quantized rows move as
    they are, with their scales."""
    def rows(a: np.ndarray) -> np.ndarray:
        n = a.shape[0]
        return a.reshape(heads, n // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    if isinstance(part, Quantized):
        return Quantized(part.bits, rows(part.codes), rows(part.scales),
                         None if part.mins is None else rows(part.mins), part.group)
    return rows(part)


def load_gguf_weights(f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype,
                      device: torch.device | str, quantization: str | None = None,
                      dequantize: bool = False) -> ModelWeights:
    """``dequantize``: every layer as floats in ``dtype`` (the file's values, exactly in fp32)
    instead of the kernels' quantized forms."""
    if quantization is not None:
        raise ModelLoadError(f"{f.path}: a GGUF model is already quantized; serve it without "
                             f"quantization={quantization!r}")
    try:
        r = _Reader(f, cfg, dtype, device, dequantize)
        weights = _load(r, cfg)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    if r.mixed:
        log.info("%d fused layers mix GGUF types: held as int8 codes (exact)", len(r.mixed))
    return weights


def _load(r: _Reader, cfg: ModelConfig) -> ModelWeights:
    D, V, I, Dh = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    Hq, Hk = cfg.num_heads, cfg.num_kv_heads
    embed_rows = r.rows("token_embd.weight", (V, D))
    table = embed_rows.dequantize() if isinstance(embed_rows, Quantized) else embed_rows
    embed = r._tensor(table)
    if "output.weight" in r.f.tensors:
        lm_head = r.linear([("output.weight", V)], D)
    elif isinstance(embed_rows, Quantized):  # tied to a quantized embedding: its codes
        lm_head = r._fuse([embed_rows], D, None, "token_embd.weight")
    else:
        lm_head = Linear(embed)
    llama = r.arch == "llama"
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        if cfg.fused_checkpoint:  # Phi-3
            qkv = r.linear([(p + "attn_qkv.weight", (Hq + 2 * Hk) * Dh)], D)
            gate_up = r.linear([(p + "ffn_up.weight", 2 * I)], D)
        else:
            qkv = r.linear([(p + "attn_q.weight", Hq * Dh), (p + "attn_k.weight", Hk * Dh),
                            (p + "attn_v.weight", Hk * Dh)], D, cfg.qkv_bias,
                           permute=[Hq, Hk, None] if llama else None)
            gate_up = r.linear([(p + "ffn_gate.weight", I), (p + "ffn_up.weight", I)], D)
        sandwich = cfg.sandwich_norms
        layers.append(LayerWeights(
            input_norm=r.norm(p + "attn_norm.weight", D),
            qkv=qkv,
            o=r.linear([(p + "attn_output.weight", D)], Hq * Dh, cfg.o_bias),
            post_norm=r.norm(p + ("post_attention_norm" if sandwich else "ffn_norm") + ".weight", D),
            gate_up=gate_up,
            down=r.linear([(p + "ffn_down.weight", D)], I),
            pre_ffn_norm=r.norm(p + "ffn_norm.weight", D) if sandwich else None,
            post_ffn_norm=r.norm(p + "post_ffw_norm.weight", D) if sandwich else None,
            q_norm=r.norm(p + "attn_q_norm.weight", Dh) if cfg.qk_norm else None,
            k_norm=r.norm(p + "attn_k_norm.weight", Dh) if cfg.qk_norm else None))
    return ModelWeights(embed=embed, layers=layers, norm=r.norm("output_norm.weight", D),
                        lm_head=lm_head, quantization=None if r.dequantize else "gguf")
