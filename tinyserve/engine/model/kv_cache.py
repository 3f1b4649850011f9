"""The KV cache's layout: its size (KVCacheSpec), its tensors per layer (LayerKV), and their
allocation. The block pool (core/block_pool.py) hands out block ids into these tensors; the
kernels read and write them through slot mappings and block tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LayerKV(NamedTuple):
    """One layer's cache: k, v [num_blocks, block_size, Hk, Dh] in the model's dtype, or int8
    with k_scale, v_scale [num_blocks, block_size, Hk] fp16 (``--kv-cache-dtype int8``)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


KVCache = list[LayerKV]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: K and V in it, unless quantized
    quantized: bool = False  # int8 K and V, an fp16 scale per token and KV head

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim + 2 if self.quantized else self.head_dim * self.dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device | str) -> KVCache:
    # One tensor per layer and per K/V (not one big tensor): the Triton interpreter copies each
    # argument's whole storage per launch, so small storages keep CPU steps cheap.
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if not spec.quantized:
        return [LayerKV(torch.zeros(shape, dtype=spec.dtype, device=device),
                        torch.zeros(shape, dtype=spec.dtype, device=device))
                for _ in range(spec.num_layers)]
    return [LayerKV(*(torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)),
                    *(torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(2)))
            for _ in range(spec.num_layers)]
