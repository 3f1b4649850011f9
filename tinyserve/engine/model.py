"""The Llama forward pass, every tensor operation a Triton kernel.

torch only allocates and views here: ``torch.empty`` for outputs, slicing/``view`` for the
q/k/v parts of the fused projection (tests/test_no_torch_compute.py holds us to it).

One step runs a flat, ragged batch of T tokens. Decode tokens (one query per sequence) come
first and use the split-KV decode kernel; the rest are prefill chunks:

    tokens  [ d0 d1 ... dD-1 | p0 p0 p0 p0 | p1 p1 | ... ]
              one per decode   chunk of seq  chunk ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.kv_cache import KVCache, LayerKV
from tinyserve.engine.loader import Int4Linear, LayerWeights, Linear, LlamaWeights, ModelConfig
from tinyserve.kernels import (
    add_rmsnorm,
    context_attention_paged,
    gather_rows,
    int4_matmul,
    int8_matmul,
    matmul,
    rotary_and_write_kv,
    silu_and_mul,
    token_attention_paged,
)
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




def linear(x: torch.Tensor, lin: Linear | Int4Linear, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x: [T, in] -> [T, out], by the way ``lin`` is stored (float, int8, or int4)."""
    if isinstance(lin, Int4Linear):
        return int4_matmul(x, lin.qweight, lin.scales, lin.zeros, lin.group_size, out=out)
    if lin.scale is not None:
        return int8_matmul(x, lin.weight, lin.scale, out=out)
    return matmul(x, lin.weight, out=out)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: LlamaWeights, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self.cfg = cfg
        self.w = weights
        self.cos, self.sin = cos, sin  # [max_len, head_dim / 2] fp32

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Returns logits [S, V] fp32 for the rows in ``batch.logits_indices``."""
        cfg, w = self.cfg, self.w
        # Phases tell a recording (a decode bucket being recorded) which scratch buffers
        # every layer may share; free otherwise. See kernels.utils.Recording.
        phase("head")
        h = gather_rows(batch.input_ids, w.embed)  # [T, D]
        residual = None
        for layer, layer_kv in zip(w.layers, kv_cache, strict=True):
            phase("layer")
            if residual is None:
                residual = h
                x = add_rmsnorm(h, layer.input_norm, cfg.rms_norm_eps)
            else:
                x = add_rmsnorm(h, layer.input_norm, cfg.rms_norm_eps, residual=residual)
            h = self._attention(x, layer, batch, layer_kv)
            x = add_rmsnorm(h, layer.post_norm, cfg.rms_norm_eps, residual=residual)
            h = linear(silu_and_mul(linear(x, layer.gate_up)), layer.down)
        phase("tail")
        x = add_rmsnorm(h, w.norm, cfg.rms_norm_eps, residual=residual)
        last = x if batch.logits_indices is None else gather_rows(batch.logits_indices, x)
        logits = empty((last.shape[0], cfg.vocab_size), torch.float32, x.device)
        return linear(last, w.lm_head, out=logits)

    def _attention(self, x: torch.Tensor, layer: LayerWeights, batch: ForwardBatch,
                   kv: LayerKV) -> torch.Tensor:
        cfg = self.cfg
        T, Hq, Hk, Dh = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = linear(x, layer.qkv)  # [T, (Hq + 2Hk) * Dh]
        q = qkv[:, : Hq * Dh].view(T, Hq, Dh)
        k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
        v = qkv[:, (Hq + Hk) * Dh :].view(T, Hk, Dh)
        k_cache, v_cache, k_scale, v_scale = kv
        rotary_and_write_kv(q, k, v, batch.positions, self.cos, self.sin, k_cache, v_cache,
                            batch.slot_mapping, k_scale, v_scale)
        o = empty((T, Hq, Dh), x.dtype, x.device)
        D = batch.num_decodes
        if D:
            token_attention_paged(q[:D], k_cache, v_cache, batch.block_tables,
                                  batch.decode_seq_lens, batch.decode_max_seq_len, out=o[:D],
                                  table_rows=batch.decode_rows, k_scale=k_scale, v_scale=v_scale)
        if T > D:
            context_attention_paged(q[D:], k_cache, v_cache, batch.block_tables,
                                    batch.prefill_seq_lens, batch.prefill_q_start,
                                    batch.prefill_max_q_len, out=o[D:],
                                    table_rows=batch.prefill_rows, k_scale=k_scale,
                                    v_scale=v_scale)
        return linear(o.view(T, Hq * Dh), layer.o)
