"""A linear layer by the way its weight is stored, and a layer's projections with their
LoRA adapters: what every mixer and feed-forward calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.lora import LoraStacks
from tinyserve.engine.model.weights import AnyLinear, Int4Linear, Int8GroupLinear
from tinyserve.kernels import int4_matmul, int8_group_matmul, int8_matmul, matmul


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


@dataclass(frozen=True, slots=True)
class Projector:
    """One layer's projections: ``lora`` holds the resident adapters (a batch's lora_slots
    says whose rows), keyed by layer and projection name (core/adapters.MODULES)."""

    layer: int
    lora: LoraStacks | None = None

    def __call__(self, name: str, x: torch.Tensor, lin: AnyLinear, batch: ForwardBatch
                 ) -> torch.Tensor:
        """x: [T, in] through ``lin``, plus its rows' adapters' share (in place)."""
        out = linear(x, lin)
        if batch.lora_slots is not None:
            self.lora.apply(self.layer, name, x, out, batch.lora_slots)
        return out
