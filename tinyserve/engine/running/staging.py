"""Host <-> device staging for the runner: pinned buffers and non-blocking copies only, so the
host never waits for the device while it prepares the next step (on a GPU a pageable
``torch.tensor(list, device=...)`` is a synchronous copy: the host would stall until the
step in flight finished).

- ``DecodeStatics``: the decode buckets' static inputs (what their recordings and CUDA graphs
  read), one host staging buffer and its device twin: one copy a step.
- ``stage``: an eager step's arrays through one pinned buffer and one copy.
- ``Readback``: a step's sampled tokens copied into pinned memory as soon as they are sampled;
  ``wait`` is the one host sync of the step, after the next step is launched.

On the CPU the same calls run: buffers are ordinary memory, copies happen at once and ``wait``
returns at once.
"""

from __future__ import annotations

import numpy as np
import torch


class DecodeStatics:
    """Static decode inputs: one host staging buffer and its device twin, as typed views.

    Layout (bytes): int64 [6, cap] (ids, positions, slots, seq lens, table rows, seeds) |
    int32 [2, cap] (top_k, LoRA adapter slots) | fp32 [2, cap] (temperature, top_p) |
    int64 [max_updates, 3] (block-table updates). A step copies the prefix up to its last
    update: one copy.
    """

    def __init__(self, capacity: int, max_updates: int, device: torch.device) -> None:
        cap = -(-capacity // 8) * 8  # keeps every section 8-byte aligned
        self.cap, self.max_updates = cap, max_updates
        self.upd_offset = 64 * cap
        nbytes = self.upd_offset + 24 * max_updates
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        h = self.host.numpy()
        self.h_i64 = h[: 48 * cap].view(np.int64).reshape(6, cap)
        self.h_topk = h[48 * cap: 52 * cap].view(np.int32)
        self.h_lora = h[52 * cap: 56 * cap].view(np.int32)
        self.h_lora[:] = -1
        self.h_f32 = h[56 * cap: 64 * cap].view(np.float32).reshape(2, cap)
        self.h_upd = h[self.upd_offset:].view(np.int64).reshape(max_updates, 3)
        d = self.dev
        i64 = d[: 48 * cap].view(torch.int64).view(6, cap)
        self.ids, self.pos, self.slots, self.lens, self.rows, self.seeds = i64.unbind(0)
        self.top_k = d[48 * cap: 52 * cap].view(torch.int32)
        self.lora_slots = d[52 * cap: 56 * cap].view(torch.int32)
        self.temperature, self.top_p = d[56 * cap: 64 * cap].view(torch.float32).view(2, cap).unbind(0)
        self.upd = d[self.upd_offset:].view(torch.int64).view(max_updates, 3)

        # On a GPU the copy is asynchronous: the host buffer is not written again until the
        # last copy out of it has run. With the next step launched before this one's tokens
        # are read, that copy was queued before the step in flight: a short wait at most.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def pad_rows(self, start: int, end: int, pad_row: int) -> None:
        """Rows [start, end) as padding: token 0 at position 0, no KV write (slot -1), one key
        in the block table's all-zero padding row. They compute garbage nobody reads."""
        self.h_i64[0:2, start:end] = 0
        self.h_i64[2, start:end] = -1
        self.h_i64[3, start:end] = 1
        self.h_i64[4, start:end] = pad_row
        self.h_lora[start:end] = -1

    def writable(self) -> None:
        """Wait until the host buffer may be written (call before staging a step)."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def push(self, num_updates: int, statics: bool = True) -> None:
        start = 0 if statics else self.upd_offset
        end = self.upd_offset + 24 * num_updates
        if end > start:
            self.dev[start:end].copy_(self.host[start:end], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
                self._pending = True


def stage(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays (int64 / int32 / float32) -> device tensors of the same shapes, through one
    pinned buffer and one non-blocking copy. The buffer comes from torch's pinned-memory cache,
    which reuses a block only once the copies out of it have run: no wait here, and none for
    the step in flight. On the CPU the arrays' own memory, as tensors (no copy)."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8  # 8-byte aligned sections
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
    h = host.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        h[off: off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    dev = host.to(device, non_blocking=True)
    return [dev[off: off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, off in zip(arrays, offsets, strict=True)]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


class Readback:
    """Device tensors of one step (sampled tokens, logprobs, top-N) copied to the host as soon
    as they are queued, into pinned memory, with an event behind the copies. ``wait`` is the
    step's one host sync: the executor calls it after the next step is launched, so the
    device is never left idle while the host waits (``tensor.tolist()`` on a CUDA tensor would
    wait for everything queued, the next step included)."""

    def __init__(self, tensors: list[torch.Tensor | None]) -> None:
        self._event = None
        if tensors and any(t is not None and t.device.type == "cuda" for t in tensors):
            self.host = [None if t is None else torch.empty(t.shape, dtype=t.dtype,
                                                            pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors, strict=True):
                if t is not None:
                    h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = list(tensors)

    @property
    def ready(self) -> bool:
        """The copies have run (a non-blocking check)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self.host
