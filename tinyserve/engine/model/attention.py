"""The attention mixer: fused q/k/v projection, rotary (with the q/k norms) fused with the
KV-cache write, paged attention (decode rows split-KV, prefill chunks ragged), o projection.

    q, k, v = x Wqkv (+ bias)              (Qwen2: bias in the matmul's epilogue)
    q, k = rope(norm(q), norm(k))          (Qwen3, Gemma 3: per-head norm; OLMoE: over all of
                                            q's or k's heads; partial rotary; Gemma 3's local
                                            layers: their own rope table)
    a = attention(q, K, V) Wo              (window per layer; soft-cap; scale; gpt-oss's sinks)
"""

from __future__ import annotations

import torch

from tinyserve.engine.loading.model_config import ModelConfig
from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.kv_cache import LayerKV
from tinyserve.engine.model.linear import Projector
from tinyserve.engine.model.rope import RopeTables
from tinyserve.engine.model.weights import LayerWeights
from tinyserve.kernels import (
    add_rmsnorm,
    context_attention_paged,
    rotary_and_write_kv,
    token_attention_paged,
)
from tinyserve.kernels.rotary import QKNorm
from tinyserve.kernels.utils import empty


class Attention:
    """Layer ``i``'s attention over its paged KV cache."""

    def __init__(self, cfg: ModelConfig, i: int, w: LayerWeights, rope: RopeTables,
                 project: Projector) -> None:
        self.w, self.project = w, project
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.cos_sin = rope.local if cfg.uses_local_rope(i) else (rope.cos, rope.sin)
        self.qk_norm = None if w.q_norm is None or cfg.qk_norm_whole else QKNorm(
            w.q_norm, w.k_norm, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.eps = cfg.rms_norm_eps
        self.whole_norms = (w.q_norm, w.k_norm) if cfg.qk_norm_whole else None
        self.shape = dict(sm_scale=cfg.attn_scale, window=cfg.window(i), softcap=cfg.attn_softcap,
                          sinks=w.sinks)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: LayerKV) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        Hq, Hk, Dh = self.heads
        T = x.shape[0]
        qkv = self.project("qkv", x, self.w.qkv, batch)  # [T, (Hq + 2Hk) * Dh]
        if self.whole_norms is not None:  # (OLMoE) in place, each row read whole first
            for part, w in zip((qkv[:, : Hq * Dh], qkv[:, Hq * Dh : (Hq + Hk) * Dh]),
                               self.whole_norms, strict=True):
                add_rmsnorm(part, w, self.eps, out=part)
        q = qkv[:, : Hq * Dh].view(T, Hq, Dh)
        k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
        v = qkv[:, (Hq + Hk) * Dh :].view(T, Hk, Dh)
        k_cache, v_cache, k_scale, v_scale = kv
        cos, sin = self.cos_sin
        rotary_and_write_kv(q, k, v, batch.positions, cos, sin, k_cache, v_cache,
                            batch.slot_mapping, k_scale, v_scale, qk_norm=self.qk_norm)
        o = empty((T, Hq, Dh), x.dtype, x.device)
        D = batch.num_decodes
        shape = dict(self.shape, k_scale=k_scale, v_scale=v_scale)
        if D:
            token_attention_paged(q[:D], k_cache, v_cache, batch.block_tables,
                                  batch.decode_seq_lens, batch.decode_max_seq_len, out=o[:D],
                                  table_rows=batch.decode_rows, **shape)
        if T > D:
            context_attention_paged(q[D:], k_cache, v_cache, batch.block_tables,
                                    batch.prefill_seq_lens, batch.prefill_q_start,
                                    batch.prefill_max_q_len, out=o[D:],
                                    table_rows=batch.prefill_rows, **shape)
        return self.project("o", o.view(T, Hq * Dh), self.w.o, batch)
