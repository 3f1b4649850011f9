"""Launcher helpers shared by every kernel file: the interpreter flag, block-size math, checks,
and the one place kernels are launched and scratch tensors allocated (so a forward pass can be
recorded once and replayed: see ``Recording``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Read once, like @triton.jit does: it decides at decoration time whether kernels are interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    # (not triton.next_power_of_2: a constexpr_function since Triton 3.4, ~2 us a call on the host)
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs: exact "ieee" products (NVIDIA would silently use tf32); others: the default."""
    return "ieee" if dtype == torch.float32 else None


def check(cond: bool, msg: str) -> None:
    """Launcher-side validation: the interpreter does no bounds checking, so fail before launch."""
    if not cond:
        raise ValueError(msg)


Launch = tuple[Callable[..., Any], tuple, dict]


class Recording:
    """Records every launch of a forward pass and serves its scratch tensors from a pool.

    A decode step of a fixed batch bucket launches the same kernels with the same arguments
    every time once its inputs live in static buffers; replaying the recorded list skips all
    launcher work (shape math, checks, allocation): the host-side twin of a CUDA graph, and
    what a graph captures. Scratch tensors come from a pool so that replays reuse them:

    - ``phase(name)`` starts a phase: allocations made in a phase with the same name as an
      earlier one reuse that phase's tensors in allocation order. The model opens one
      "layer" phase per decoder layer, so all layers share one set of buffers; only a
      layer's output (allocated late in the layer) is read by the next, before the next
      layer's own allocation of that buffer writes it.
    - tensors are allocated with ``capacity`` rows (the largest bucket) and handed out as
      ``[:rows]`` views, so every bucket shares the same memory.

    Only launchers that route through ``launch``/``empty`` are recorded; a launch made while no
    recording is active runs as usual.
    """

    def __init__(self, capacity: int, pools: dict | None = None) -> None:
        self.capacity = capacity
        self.launches: list[Launch] = []
        # (phase, trailing shape, dtype, device) -> tensors; pass one dict to several
        # recordings (buckets) that never run at the same time to share their scratch.
        self._pools: dict[tuple, list[torch.Tensor]] = {} if pools is None else pools
        self._used: dict[tuple, int] = {}
        self._phase = "prologue"

    def phase(self, name: str) -> None:
        self._phase = name
        self._used = {k: v for k, v in self._used.items() if k[0] != name}

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        rows, rest = int(shape[0]), tuple(int(s) for s in shape[1:])
        check(rows <= self.capacity, f"{rows} rows exceed the recording's capacity {self.capacity}")
        key = (self._phase, rest, dtype, torch.device(device))
        pool = self._pools.setdefault(key, [])
        i = self._used.get(key, 0)
        if i == len(pool):
            pool.append(torch.empty((self.capacity, *rest), dtype=dtype, device=device))
        self._used[key] = i + 1
        return pool[i][:rows]

    def replay(self) -> None:
        for run, args, meta in self.launches:
            run(*args, **meta)


class _Active(threading.local):
    # Per thread: two runners on two threads (two servers in one process, a test's
    # reference engine beside a server's) must not record each other's launches
    rec: Recording | None = None


_active = _Active()


class recording:  # noqa: N801 - a context manager, used like a function
    """``with recording(rec): model.forward(...)`` records into ``rec`` (not re-entrant)."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec

    def __enter__(self) -> Recording:
        check(_active.rec is None, "a recording is already active")
        _active.rec = self.rec
        return self.rec

    def __exit__(self, *exc) -> None:
        _active.rec = None


def phase(name: str) -> None:
    """Mark the start of a phase of the forward pass (see ``Recording``); free otherwise."""
    if (rec := _active.rec) is not None:
        rec.phase(name)


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if (rec := _active.rec) is not None:
        return rec.empty(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, recorded when a recording is active."""
    meta["grid"] = grid
    meta["warmup"] = False
    kernel.run(*args, **meta)
    if (rec := _active.rec) is not None:
        rec.launches.append((kernel.run, args, meta))
