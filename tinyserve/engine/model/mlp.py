"""The dense feed-forward: h = act(x Wg) * (x Wu) Wd, gate and up fused into one projection
(SiLU, or GELU-tanh for Gemma)."""

from __future__ import annotations

import torch

from tinyserve.engine.loading.model_config import ModelConfig
from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.linear import Projector
from tinyserve.engine.model.weights import LayerWeights
from tinyserve.kernels import silu_and_mul


class DenseMLP:
    def __init__(self, cfg: ModelConfig, w: LayerWeights, project: Projector) -> None:
        self.w, self.project, self.activation = w, project, cfg.activation

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        gate_up = self.project("gate_up", x, self.w.gate_up, batch)  # [T, 2I]
        act = silu_and_mul(gate_up, activation=self.activation)  # [T, I]
        return self.project("down", act, self.w.down, batch)
