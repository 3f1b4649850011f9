"""LoRA on the device: the resident adapters' weights stacked by slot, the host copies they
are loaded from, and their part of each projection (kernels/lora.py).

Per layer and projection, A stacked over the projection's slices, B per slice:

    qkv:     A [S, 3R, D]  (q | k | v)    B_q [S, Hq*Dh, R]  B_k, B_v [S, Hk*Dh, R]
    o:       A [S, R, Hq*Dh]              B   [S, D, R]
    gate_up: A [S, 2R, D]  (gate | up)    B_g, B_u [S, I, R]
    down:    A [S, R, I]                  B   [S, D, R]
    scale:   [S] fp32 (alpha / r, rsLoRA alpha / sqrt(r))

S = max_loras slots, R = max_lora_rank: an adapter of rank r fills its first r rows of A and
columns of B, zeros after; a module it does not target is all zeros (a slot is written whole
on every load, so nothing of the adapter before survives). A fused module of the checkpoint
(Phi-3's qkv_proj, gate_up_proj) puts its A in every slice and splits its B by rows: the same
product. A projection's output gets, for each token row whose slot is not -1:

    out[t, slice] += scale[s] * (x[t] A_slice[s]^T) B_slice[s]^T      s = slot of t

Host copies: ``HostAdapters`` keeps up to ``max_cpu_loras`` adapters read from disk (least
recently used dropped first; pinned on a GPU, so a load is one non-blocking copy per tensor).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from tinyserve.core.adapters import MODULES, ModelDims
from tinyserve.kernels.lora import lora_expand, lora_shrink
from tinyserve.kernels.utils import empty

log = logging.getLogger(__name__)

PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class ProjectionLora:
    a: torch.Tensor  # [S, n_slices * R, K]
    b: list[torch.Tensor]  # per slice [S, N_slice, R]
    offsets: list[int]  # each slice's first output column


class LoraStacks:
    """The device side of ``max_loras`` adapter slots for one model."""

    def __init__(self, dims: ModelDims, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.dims, self.max_loras, self.max_rank = dims, max_loras, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        S, R = max_loras, max_rank
        self.layers: list[dict[str, ProjectionLora]] = []
        for _ in range(dims.num_layers):
            layer = {}
            for proj in PROJECTIONS:
                widths = dims.slices(proj)
                offsets = [sum(widths[:i]) for i in range(len(widths))]
                layer[proj] = ProjectionLora(
                    torch.zeros((S, len(widths) * R, dims.in_width(proj)), dtype=dtype,
                                device=device),
                    [torch.zeros((S, n, R), dtype=dtype, device=device) for n in widths],
                    offsets)
            self.layers.append(layer)
        self.scales = torch.zeros(S, dtype=torch.float32, device=device)
        # Which adapter each slot holds; None until a load into it has succeeded (a slot whose
        # load failed is never run with what it held before)
        self.resident: list[int | None] = [None] * S

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for p in layer.values() for t in (p.a, *p.b))

    def load(self, slot: int, host: HostAdapter) -> None:
        """Write a slot whole from a host copy (stream-ordered, non-blocking on a GPU)."""
        self.resident[slot] = None
        for i, layer in enumerate(self.layers):
            for proj, p in layer.items():
                a_host, b_host = host.tensors[i][proj]
                p.a[slot].copy_(a_host, non_blocking=True)
                for b, bh in zip(p.b, b_host, strict=True):
                    b[slot].copy_(bh, non_blocking=True)
        self.scales[slot:slot + 1].copy_(host.scale, non_blocking=True)
        self.resident[slot] = host.adapter_id

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor,
              slots: torch.Tensor) -> None:
        """out [T, N] += each row's adapter's share of projection ``proj`` of x [T, K]."""
        p = self.layers[layer][proj]
        R = self.max_rank
        y = empty((x.shape[0], p.a.shape[1]), torch.float32, x.device)
        lora_shrink(x, p.a, slots, out=y)
        for j, (b, offset) in enumerate(zip(p.b, p.offsets, strict=True)):
            lora_expand(y, b, slots, self.scales, out, y_offset=j * R, out_offset=offset)


@dataclass(slots=True)
class HostAdapter:
    """One adapter in host memory, laid out as a slot: tensors[layer][proj] = (A, [B...])."""

    adapter_id: int
    tensors: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]]
    scale: torch.Tensor  # [1] fp32


class HostAdapters:
    """Up to ``capacity`` adapters read from disk, least recently used dropped first. Read and
    checked whole when the server loads an adapter (any thread), again from disk after an
    eviction (the step thread): the lock guards only the cache's order."""

    def __init__(self, dims: ModelDims, max_rank: int, dtype: torch.dtype,
                 device: torch.device, capacity: int) -> None:
        self.dims, self.max_rank, self.dtype = dims, max_rank, dtype
        self.pin = torch.device(device).type == "cuda"
        self.capacity = capacity
        self._cache: OrderedDict[int, HostAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.num_reads = 0  # adapters read from disk

    def get(self, adapter_id: int, path: str, scale: float) -> HostAdapter:
        """The adapter's host copy (ValueError: it can no longer be read whole and sound)."""
        with self._lock:
            hit = self._cache.get(adapter_id)
            if hit is not None:
                self._cache.move_to_end(adapter_id)
                return hit
        return self.read(adapter_id, path, scale)

    def read(self, adapter_id: int, path: str, scale: float) -> HostAdapter:
        """Read from disk, check every tensor, keep it (the newest)."""
        host = self._read(adapter_id, path, scale)
        with self._lock:
            self._cache[adapter_id] = host
            self._cache.move_to_end(adapter_id)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return host

    def forget(self, adapter_id: int) -> None:
        with self._lock:
            self._cache.pop(adapter_id, None)

    def _read(self, adapter_id: int, path: str, scale: float) -> HostAdapter:
        """The checkpoint's tensors in a slot's layout (read_adapter checked the header), each
        finite in the model's dtype; ValueError naming the file and tensor otherwise."""
        dims, R = self.dims, self.max_rank
        self.num_reads += 1
        if not math.isfinite(torch.tensor(scale, dtype=torch.float32).item()):
            raise ValueError(f"{path}: its scale {scale:g} is not finite in float32")

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, pin_memory=self.pin)

        tensors = []
        for _ in range(dims.num_layers):
            layer = {}
            for proj in PROJECTIONS:
                widths = dims.slices(proj)
                layer[proj] = (zeros(len(widths) * R, dims.in_width(proj)),
                               [zeros(n, R) for n in widths])
            tensors.append(layer)
        file = f"{path}/adapter_model.safetensors"
        try:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    if key.split(".")[-2] == "lora_A":
                        self._place(tensors, key, f)
        except ValueError as e:  # (a tensor not finite)
            raise ValueError(f"{file}: {e}") from None
        except Exception as e:  # (safetensors' own errors, OSError: a file changed or gone)
            raise ValueError(f"{file}: cannot be read: {type(e).__name__}: {e}") from None
        log.info("LoRA adapter %d read from %s", adapter_id, path)
        scale_t = torch.tensor([scale], dtype=torch.float32)
        return HostAdapter(adapter_id, tensors, scale_t.pin_memory() if self.pin else scale_t)

    def _place(self, tensors: list, key: str, f: Any) -> None:
        """One module's A and B into its layer's slot layout."""
        dims, R = self.dims, self.max_rank
        parts = key.split(".")  # base_model.model.model.layers.{i}.{attn|mlp}.{mod}...
        layer_i, module = int(parts[4]), parts[6]
        a = _finite(f.get_tensor(key).to(self.dtype), key)  # [r, K]
        b_key = key.replace("lora_A", "lora_B")
        b = _finite(f.get_tensor(b_key).to(self.dtype), b_key)  # [N, r]
        r = a.shape[0]
        proj, part = MODULES[module]
        a_dst, b_dst = tensors[layer_i][proj]
        widths = dims.slices(proj)
        parts_of = range(len(widths)) if part is None else [part]
        row = 0
        for j in parts_of:  # a fused module: its A in each slice, its B split by rows
            a_dst[j * R: j * R + r].copy_(a)
            rows = b[row: row + widths[j]] if part is None else b
            b_dst[j][:, :r].copy_(rows)
            row += widths[j]


def _finite(t: torch.Tensor, key: str) -> torch.Tensor:
    """t, if every value is finite (in the dtype it is held in)."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"tensor {key}: {bad} of {t.numel()} values are NaN or infinite "
                         f"in {str(t.dtype).removeprefix('torch.')}")
    return t
