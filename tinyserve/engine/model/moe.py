"""The sparse feed-forward (mixture of experts): a router picks each token's top k experts and
their weights, and the token's output is the weighted sum of those experts' SwiGLU MLPs, all in
kernels/moe.py (route, sort by expert, two grouped GEMMs over the sorted tiles, a fixed-order
combine: a token's output never depends on which tokens share its step).

    logits = x Wr^T                          [T, E] (the router, a plain linear)
    w, ids = route(logits)                   top k: softmax over all then top k (renormalised
                                             or not), or top k then a softmax over those
    out[t] = sum_j w[t, j] * down_e(act(gate_e(x)) * up_e(x)),  e = ids[t, j]
             [+ sigmoid(x Wsg) * shared(x)]     Qwen2-MoE's shared expert, a dense MLP
    gpt-oss: the router has a bias; top k then a softmax; experts with biases and the clamped
    SwiGLU over interleaved gate / up rows (kernels/moe.py's swiglu_oai)

The operator's view (``ExpertLoad``): the routing kernel adds each expert's rows (real tokens
only: a decode bucket's padding has no KV slot) to a per-layer device counter; the runner
copies the counters to the host with a step's tokens about once a second.
"""

from __future__ import annotations

import torch

from tinyserve.engine.loading.model_config import ModelConfig
from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.linear import linear
from tinyserve.engine.model.weights import ExpertWeights
from tinyserve.kernels import fused_moe, silu_and_mul


class ExpertLoad:
    """Tokens routed to each expert of each sparse layer since the model was built: int64
    [sparse layers, E] on the device, only ever added to (so a CUDA graph's replays add too)."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device) -> None:
        self.layers = tuple(layers)  # the model's index of each row's layer
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)

    def row(self, layer: int) -> torch.Tensor:
        return self.counts[self.layers.index(layer)]


class SparseMoE:
    def __init__(self, cfg: ModelConfig, experts: ExpertWeights,
                 counts: torch.Tensor | None = None) -> None:
        self.counts = counts  # [E] int64: this layer's row of ExpertLoad (None: not counted)
        self.w, self.top_k = experts, cfg.experts_per_token
        self.softmax_first, self.renormalize = cfg.moe_softmax_first, cfg.moe_renormalize
        self.activation = cfg.activation  # the shared expert's
        self.expert_activation = cfg.moe_activation or cfg.activation
        self.swiglu = dict(swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        w = self.w
        logits = linear(x, w.router)  # [T, E] (+ the router's bias: gpt-oss)
        shared = gate = None
        if w.shared_gate_up is not None:  # (Qwen2-MoE) added in the combine
            act = silu_and_mul(linear(x, w.shared_gate_up), activation=self.activation)
            shared, gate = linear(act, w.shared_down), linear(x, w.shared_gate)  # [T, D], [T, 1]
        return fused_moe(x, logits, w.w13, w.w2, self.top_k, softmax_first=self.softmax_first,
                         renormalize=self.renormalize, activation=self.expert_activation,
                         w13_bias=w.w13_bias, w2_bias=w.w2_bias, **self.swiglu,
                         shared=shared, shared_gate=gate, w13_scale=w.w13_scale,
                         w2_scale=w.w2_scale, counts=self.counts,
                         rows=None if self.counts is None else batch.slot_mapping)
