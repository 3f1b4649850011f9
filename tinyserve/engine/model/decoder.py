"""The decoder forward pass, every tensor operation a Triton kernel, configured by the model
description (loading/model_config.py) rather than written per family.

torch only allocates and views here: ``torch.empty`` for outputs, slicing/``view`` for the
q/k/v parts of the fused projection (tests/engine/test_no_torch_compute.py holds us to it).

A layer is a mixer and a feed-forward between norms; each layer's are picked by the config
(every mixer is attention.py's; a feed-forward is mlp.py's dense one or moe.py's sparse one; a
new kind - linear attention - is a new class and a line in ``_mixer`` / ``_feed_forward``):

    x = norm(h + residual)                 (Gemma: x (1 + w), fp32)
    a = mixer(x)                           (attention.py)
    [a = norm(a)]                          (Gemma: post-attention norm, then the pre-FFN
    x = norm(a + residual)                  norm of the residual sum)
    h = feed_forward(x)                    (mlp.py)
    [h = norm(h)]                          (Gemma: post-FFN norm)

then the final norm and the LM head (Gemma 2: logits soft-capped in the head's epilogue).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyserve.engine.loading.model_config import ModelConfig
from tinyserve.engine.model.attention import Attention
from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.kv_cache import KVCache, LayerKV
from tinyserve.engine.model.linear import Projector, linear
from tinyserve.engine.model.lora import LoraStacks
from tinyserve.engine.model.mlp import DenseMLP
from tinyserve.engine.model.moe import ExpertLoad, SparseMoE
from tinyserve.engine.model.rope import RopeTables
from tinyserve.engine.model.weights import LayerWeights, ModelWeights
from tinyserve.kernels import add_rmsnorm, gather_rows
from tinyserve.kernels.utils import empty, phase

Mixer = Callable[[torch.Tensor, ForwardBatch, LayerKV], torch.Tensor]  # x [T, D] -> [T, D]
FeedForward = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]  # x [T, D] -> [T, D]


class DecoderLayer:
    """Norms around layer ``i``'s mixer and feed-forward."""

    def __init__(self, model: DecoderModel, i: int, w: LayerWeights, mixer: Mixer,
                 feed_forward: FeedForward) -> None:
        self.norm, self.w = model.norm, w
        self.sandwich = model.cfg.sandwich_norms
        self.mixer, self.feed_forward = mixer, feed_forward

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                 kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) in, (h, residual) out: each sum with the residual is fused into the
        norm after it (the first layer's residual is the embedding itself)."""
        w, norm = self.w, self.norm
        if residual is None:
            residual = h
            x = norm(h, w.input_norm)
        else:
            x = norm(h, w.input_norm, residual)
        h = self.mixer(x, batch, kv)
        if self.sandwich:  # (Gemma) the mixer's output normed before the sum
            h = norm(h, w.post_norm)
            x = norm(h, w.pre_ffn_norm, residual)
        else:
            x = norm(h, w.post_norm, residual)
        h = self.feed_forward(x, batch)
        if self.sandwich:
            h = norm(h, w.post_ffn_norm)
        return h, residual


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope: RopeTables,
                 lora: LoraStacks | None = None, count_experts: bool = False) -> None:
        self.cfg = cfg
        self.w = weights
        self.rope = rope
        self.lora = lora  # the resident adapters (a batch's lora_slots says whose rows)
        # Gemma scales embeddings by sqrt(hidden), rounded to the model dtype (transformers)
        self.embed_scale = None if cfg.embed_scale is None else float(
            torch.tensor(cfg.embed_scale, dtype=weights.embed.dtype))
        sparse = [i for i, w in enumerate(weights.layers) if w.experts is not None]
        # per-expert token counts for /metrics (the served model's; a draft's are not counted)
        self.expert_load = ExpertLoad(sparse, cfg.num_experts, weights.embed.device) \
            if count_experts and sparse else None
        self.layers = []
        for i, w in enumerate(weights.layers):
            project = Projector(i, lora)
            self.layers.append(DecoderLayer(self, i, w, self._mixer(i, w, project),
                                            self._feed_forward(i, w, project)))

    def _mixer(self, i: int, w: LayerWeights, project: Projector) -> Mixer:
        return Attention(self.cfg, i, w, self.rope, project)

    def _feed_forward(self, i: int, w: LayerWeights, project: Projector) -> FeedForward:
        if w.experts is not None:
            load = self.expert_load
            return SparseMoE(self.cfg, w.experts, None if load is None else load.row(i))
        return DenseMLP(self.cfg, w, project)

    def norm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
        """RMSNorm of x (+ residual, which then holds the sum)."""
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
        for layer, layer_kv in zip(self.layers, kv_cache, strict=True):
            phase("layer")
            h, residual = layer(h, residual, batch, layer_kv)
        phase("tail")
        x = self.norm(h, w.norm, residual)
        last = x if batch.logits_indices is None else gather_rows(batch.logits_indices, x)
        logits = empty((last.shape[0], cfg.vocab_size), torch.float32, x.device)
        return linear(last, w.lm_head, out=logits, softcap=cfg.final_softcap)
