"""The decoder forward pass, every tensor operation a Triton kernel, configured by the model
description (model_config.py) rather than written per family.

torch only allocates and views here: ``torch.empty`` for outputs, slicing/``view`` for the
q/k/v parts of the fused projection (tests/test_no_torch_compute.py holds us to it).

One step runs a flat, ragged batch of T tokens. Decode tokens (one query per sequence) come
first and use the split-KV decode kernel; the rest are prefill chunks:

    tokens  [ d0 d1 ... dD-1 | p0 p0 p0 p0 | p1 p1 | ... ]
              one per decode   chunk of seq  chunk ...

A layer, with the switches that change it:

    x = norm(h + residual)                 (Gemma: x (1 + w), fp32)
    q, k, v = x Wqkv (+ bias)              (Qwen2: bias in the matmul's epilogue)
    q, k = rope(norm(q), norm(k))          (Qwen3, Gemma 3: per-head norm; partial rotary;
                                            Gemma 3's local layers: their own rope table)
    a = attention(q, K, V) Wo              (window per layer; soft-cap; scale)
    [a = norm(a)]                          (Gemma: post-attention norm, then the pre-FFN
    x = norm(a + residual)                  norm of the residual sum)
    h = act(x Wg) * (x Wu) Wd              (SiLU or GELU-tanh)
    [h = norm(h)]                          (Gemma: post-FFN norm)

then the final norm and the LM head (Gemma 2: logits soft-capped in the head's epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.kv_cache import KVCache, LayerKV
from tinyserve.engine.loader import AnyLinear, Int4Linear, Int8GroupLinear, LayerWeights, ModelWeights
from tinyserve.engine.lora import LoraStacks
from tinyserve.engine.model_config import ModelConfig
from tinyserve.engine.rope import RopeTables
from tinyserve.kernels import (
    add_rmsnorm,
    context_attention_paged,
    gather_rows,
    int4_matmul,
    int8_group_matmul,
    int8_matmul,
    matmul,
    rotary_and_write_kv,
    silu_and_mul,
    token_attention_paged,
)
from tinyserve.kernels.rotary import QKNorm
from tinyserve.kernels.utils import empty, phase


@dataclass(slots=True)
class ForwardBatch:
    """Per-step metadata, all device tensors except the host ints that size grids."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset
    num_decodes: int  # the first num_decodes tokens are decode queries
    block_tables: torch.Tensor  # [R, max_blocks] int32: the runner's persistent table
    decode_rows: torch.Tensor  # [num_decodes]: each decode's row in block_tables
    decode_seq_lens: torch.Tensor  # [num_decodes], including the new token
    decode_max_seq_len: int  # sizes the split grid (a bucket uses max_model_len: fixed)
    prefill_rows: torch.Tensor  # [P]: each prefill chunk's row in block_tables
    prefill_seq_lens: torch.Tensor  # [P] int32, cached + new tokens
    prefill_q_start: torch.Tensor  # [P + 1] int32, offsets into the prefill part
    prefill_max_q_len: int
    logits_indices: torch.Tensor | None  # [S] int64: rows whose next token is sampled (None: all)
    lora_slots: torch.Tensor | None = None  # [T] int32: each row's adapter slot (-1: base)




def linear(x: torch.Tensor, lin: AnyLinear, out: torch.Tensor | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """x: [T, in] -> [T, out], by the way ``lin`` is stored (float, int8 per channel, int4 or
    int8 group-wise); its bias (and a soft-cap) in the epilogue."""
    if isinstance(lin, Int4Linear):
        return int4_matmul(x, lin.qweight, lin.scales, lin.zeros, lin.group_size, mins=lin.mins,
                           out=out, bias=lin.bias, softcap=softcap)
    if isinstance(lin, Int8GroupLinear):
        return int8_group_matmul(x, lin.codes, lin.scales, lin.group_size, mins=lin.mins,
                                 out=out, bias=lin.bias, softcap=softcap)
    if lin.scale is not None:
        return int8_matmul(x, lin.weight, lin.scale, out=out, bias=lin.bias, softcap=softcap)
    return matmul(x, lin.weight, out=out, bias=lin.bias, softcap=softcap)


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope: RopeTables,
                 lora: LoraStacks | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.rope = rope
        self.lora = lora  # the resident adapters (a batch's lora_slots says whose rows)
        # Gemma scales embeddings by sqrt(hidden), rounded to the model dtype (transformers)
        self.embed_scale = None if cfg.embed_scale is None else float(
            torch.tensor(cfg.embed_scale, dtype=weights.embed.dtype))
        self.qk_norms = [None if layer.q_norm is None else QKNorm(
            layer.q_norm, layer.k_norm, cfg.rms_norm_eps, cfg.norm_unit_offset)
            for layer in weights.layers]

    def _norm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None
              ) -> torch.Tensor:
        return add_rmsnorm(x, w, self.cfg.rms_norm_eps, residual=residual,
                           unit_offset=self.cfg.norm_unit_offset)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Returns logits [S, V] fp32 for the rows in ``batch.logits_indices``."""
        cfg, w = self.cfg, self.w
        # Phases tell a recording (a decode bucket being recorded) which scratch buffers
        # every layer may share; free otherwise. See kernels.utils.Recording.
        phase("head")
        h = gather_rows(batch.input_ids, w.embed, scale=self.embed_scale)  # [T, D]
        residual = None
        for i, (layer, layer_kv) in enumerate(zip(w.layers, kv_cache, strict=True)):
            phase("layer")
            if residual is None:
                residual = h
                x = self._norm(h, layer.input_norm)
            else:
                x = self._norm(h, layer.input_norm, residual)
            h = self._attention(i, x, layer, batch, layer_kv)
            if cfg.sandwich_norms:  # (Gemma) the attention output normed before the sum
                h = self._norm(h, layer.post_norm)
                x = self._norm(h, layer.pre_ffn_norm, residual)
            else:
                x = self._norm(h, layer.post_norm, residual)
            gate_up = self._lora(i, "gate_up", x, linear(x, layer.gate_up), batch)
            act = silu_and_mul(gate_up, activation=cfg.activation)
            h = self._lora(i, "down", act, linear(act, layer.down), batch)
            if cfg.sandwich_norms:
                h = self._norm(h, layer.post_ffn_norm)
        phase("tail")
        x = self._norm(h, w.norm, residual)
        last = x if batch.logits_indices is None else gather_rows(batch.logits_indices, x)
        logits = empty((last.shape[0], cfg.vocab_size), torch.float32, x.device)
        return linear(last, w.lm_head, out=logits, softcap=cfg.final_softcap)

    def _attention(self, i: int, x: torch.Tensor, layer: LayerWeights, batch: ForwardBatch,
                   kv: LayerKV) -> torch.Tensor:
        cfg = self.cfg
        T, Hq, Hk, Dh = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._lora(i, "qkv", x, linear(x, layer.qkv), batch)  # [T, (Hq + 2Hk) * Dh]
        q = qkv[:, : Hq * Dh].view(T, Hq, Dh)
        k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
        v = qkv[:, (Hq + Hk) * Dh :].view(T, Hk, Dh)
        k_cache, v_cache, k_scale, v_scale = kv
        cos, sin = self.rope.local if cfg.uses_local_rope(i) else (self.rope.cos, self.rope.sin)
        rotary_and_write_kv(q, k, v, batch.positions, cos, sin, k_cache, v_cache,
                            batch.slot_mapping, k_scale, v_scale, qk_norm=self.qk_norms[i])
        o = empty((T, Hq, Dh), x.dtype, x.device)
        D = batch.num_decodes
        shape = dict(sm_scale=cfg.attn_scale, window=cfg.window(i), softcap=cfg.attn_softcap,
                     k_scale=k_scale, v_scale=v_scale)
        if D:
            token_attention_paged(q[:D], k_cache, v_cache, batch.block_tables,
                                  batch.decode_seq_lens, batch.decode_max_seq_len, out=o[:D],
                                  table_rows=batch.decode_rows, **shape)
        if T > D:
            context_attention_paged(q[D:], k_cache, v_cache, batch.block_tables,
                                    batch.prefill_seq_lens, batch.prefill_q_start,
                                    batch.prefill_max_q_len, out=o[D:],
                                    table_rows=batch.prefill_rows, **shape)
        o = o.view(T, Hq * Dh)
        return self._lora(i, "o", o, linear(o, layer.o), batch)

    def _lora(self, i: int, proj: str, x: torch.Tensor, out: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        """out (x through the base projection) plus its rows' adapters' share (in place)."""
        if batch.lora_slots is not None:
            self.lora.apply(i, proj, x, out, batch.lora_slots)
        return out
