"""Rotary tables: cos, sin [max_len, rotary_dim / 2] fp32, computed as transformers' rope-init
functions and rotary embeddings compute them (modeling_rope_utils.py), so every scaling lives
in the table and the rotary kernel never changes:

    default   inv_freq = theta ^ (-2i / dim)
    linear    inv_freq / factor
    llama3    low frequencies / factor, high ones kept, blended in between
    yarn      interpolation / extrapolation blended by a linear ramp; cos and sin times the
              attention factor (0.1 ln(factor) + 1, or from mscale / mscale_all_dim)
    dynamic   NTK: theta grows with the sequence length once it passes max_position_embeddings
    longrope  inv_freq / short_factor below original_max_position_embeddings, / long_factor
              from it; cos and sin times sqrt(1 + ln(factor) / ln(original))
    freq_factors  inv_freq / a factor per frequency (a GGUF's rope_freqs tensor: llama.cpp
              stores llama3 scaling so)

dynamic and longrope are where transformers recomputes the frequencies in the forward pass,
from the batch's longest position (``dynamic_rope_update``). Here each table row is computed
for its own position: row p uses the frequencies transformers would use for a sequence whose
current length is p + 1 (dynamic: seq_len = max(p + 1, max_position_embeddings); longrope:
long factors iff p + 1 > original). For decode that is exactly transformers' per-step choice;
a prompt that crosses the threshold is rotated per token where transformers uses the prompt's
length for all of its tokens (and its batch's longest, when batched). It keeps every token's
rotation a function of its own position: batch invariant, and cached keys never change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tinyserve.engine.loading.model_config import ModelConfig


def inv_freq(theta: float, scaling: dict[str, Any] | None, dim: int,
             max_position_embeddings: int, seq_len: int | None = None
             ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] fp32, attention factor) for one rope at a sequence
    length (dynamic and longrope depend on it; the others ignore it)."""
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (theta ** exps)
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, scaling, dim, max_position_embeddings)
    if kind == "dynamic":
        factor = float(scaling["factor"])
        seq = max(seq_len or max_position_embeddings, max_position_embeddings)
        grown = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (grown ** exps), 1.0
    if kind == "longrope":
        return _longrope(theta, scaling, exps, max_position_embeddings, seq_len)
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor (llama.cpp's llama3 scaling)
        return base / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    raise ValueError(f"rope type {kind!r} is not supported")


def _llama3(base: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Keep high frequencies, divide low ones by ``factor``, blend smoothly in between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > old_len / low, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, s: dict[str, Any], dim: int, max_position_embeddings: int
          ) -> tuple[torch.Tensor, float]:
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    freqs = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freqs, float(attention)


def _longrope(theta: float, s: dict[str, Any], exps: torch.Tensor,
              max_position_embeddings: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** exps), float(attention)


@dataclass(frozen=True, slots=True)
class RopeTables:
    """cos, sin [max_len, rotary_dim / 2] fp32; ``local``: Gemma 3's sliding layers' own
    (cos, sin) (None: every layer uses the main ones)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device | str) -> RopeTables:
    """Every table the model's layers rotate with, for positions [0, max_len)."""
    cos, sin = rope_table(cfg, max_len, device)
    local = rope_table(cfg, max_len, device, local=True) if cfg.local_rope_theta else None
    return RopeTables(cos, sin, local)


def rope_table(cfg: ModelConfig, max_len: int, device: torch.device | str,
               local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, rotary_dim / 2] fp32 for the model's rope (``local``: Gemma 3's
    sliding layers' own), times the attention factor, computed as transformers does (fp32
    products of positions and frequencies)."""
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    scaling = cfg.local_rope_scaling if local else cfg.rope_scaling
    dim = cfg.rotary_dim or cfg.head_dim
    mpe = cfg.max_position_embeddings
    positions = torch.arange(max_len, dtype=torch.float32)
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "longrope":  # rows from original_max_position_embeddings on: long factors
        original = int(scaling["original_max_position_embeddings"])
        short, factor = inv_freq(theta, scaling, dim, mpe, original)
        long, _ = inv_freq(theta, scaling, dim, mpe, original + 1)
        freq = torch.where(positions[:, None] < original, short[None, :], long[None, :])
        freqs = positions[:, None] * freq
    elif kind == "dynamic":  # row p: theta grown for a sequence of p + 1 (once past mpe)
        f = float(scaling["factor"])
        seq = torch.clamp(positions + 1, min=mpe)
        grown = theta * ((f * seq / mpe) - (f - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        freqs = positions[:, None] * (1.0 / (grown[:, None] ** exps[None, :]))
        factor = 1.0
    else:
        freq, factor = inv_freq(theta, scaling, dim, mpe)
        freqs = positions[:, None] * freq[None, :]
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    return cos.contiguous().to(device), sin.contiguous().to(device)

