"""Decode buckets: their sizes, the KV lengths a recording is sized for, the recorded forward
passes (``DecodeBuckets``), and their CUDA graphs, captured together.

``torch.cuda.graph`` synchronizes, collects garbage and empties the allocator's cache for
every graph it captures (45 to 81 buckets x split classes: seconds of it), and captures in
the global mode, where any CUDA call from another thread aborts the capture. Here the whole
set is captured after one synchronize and one cleanup, into one memory pool, on a side
stream, with capture errors local to the capturing thread.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from tinyserve.kernels.utils import Recording, next_pow2, recording


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then 2^k and 1.5 * 2^k (at most a third of a bucket is padding), capped."""
    sizes = {1, 2, 4, 8}
    p = 16
    while p < max_num_seqs:
        sizes |= {p, p * 3 // 2}
        p *= 2
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def split_class(longest: int, max_model_len: int) -> int:
    """The decode length a recording is sized for: the batch's longest sequence rounded up
    to a power-of-two number of KV splits (capped at max_model_len). A fixed grid must
    cover the longest; one per power of two keeps short batches off a 128k-sized grid of
    idle programs, at log2(max_model_len / split) recordings per bucket."""
    from tinyserve.kernels.attention_decode import default_split_size

    split = default_split_size()
    return min(next_pow2(-(-longest // split)) * split, max_model_len)


def split_classes(max_model_len: int) -> list[int]:
    """Every split class up to max_model_len (what the warm-up records)."""
    from tinyserve.kernels.attention_decode import default_split_size

    classes, n, split = [], 1, default_split_size()
    while True:
        classes.append(min(n * split, max_model_len))
        if n * split >= max_model_len:
            return classes
        n *= 2


def capture(recorded: dict, device: torch.device, pool) -> dict:
    """recorded: (bucket, split class) -> (recording, logits buffer, graph or None); every
    entry without a graph gets one (in place). -> how many, how long, how much memory."""
    todo = [k for k, (_, _, g) in recorded.items() if g is None]
    if not todo:
        return {"graphs": 0, "seconds": 0.0, "memory_mib": 0.0}
    t0 = time.perf_counter()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for key in todo:
            rec, logits, _ = recorded[key]
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                rec.replay()
            finally:
                graph.capture_end()
            recorded[key] = (rec, logits, graph)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    used = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20
    return {"graphs": len(todo), "seconds": round(time.perf_counter() - t0, 2),
            "memory_mib": round(used, 1)}


class DecodeBuckets:
    """The recorded decode steps: (bucket size, split class) -> the recording of that
    forward pass, its logits buffer and (on a GPU) the CUDA graph captured from it. Every
    recording shares one set of scratch buffers (``Recording``'s pools)."""

    def __init__(self, sizes: tuple[int, ...], max_model_len: int, device: torch.device,
                 use_graphs: bool) -> None:
        self.sizes = sizes  # () with enforce_eager: every step runs the launchers directly
        self.max_model_len = max_model_len
        self.device = device
        self.use_graphs = use_graphs
        self._pools: dict = {}
        self._recorded: dict[tuple[int, int], tuple[Recording, torch.Tensor, object]] = {}
        self._graph_pool = None  # one memory pool for every captured bucket

    def size_for(self, n: int) -> int:
        """The smallest bucket that holds n decodes."""
        for b in self.sizes:
            if b >= n:
                return b
        raise ValueError(f"{n} decodes exceed the largest bucket")

    def split_class(self, longest: int) -> int:
        return split_class(longest, self.max_model_len)

    def split_classes(self) -> list[int]:
        return split_classes(self.max_model_len)

    @property
    def recorded(self) -> frozenset[tuple[int, int]]:
        """The (bucket, split class) pairs recorded so far."""
        return frozenset(self._recorded)

    def replay(self, key: tuple[int, int]) -> torch.Tensor | None:
        """Run a recorded bucket (its graph on a GPU) on what the statics hold: its logits
        buffer, or None if it was never recorded."""
        recorded = self._recorded.get(key)
        if recorded is None:
            return None
        rec, logits, graph = recorded
        if graph is not None:
            graph.replay()
        else:
            rec.replay()
        return logits

    def record(self, key: tuple[int, int], forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``forward`` (it runs once, on whatever the statics hold) as bucket ``key``;
        returns its logits buffer."""
        if key in self._recorded:
            return self._recorded[key][1]
        rec = Recording(self.sizes[-1], self._pools)
        with recording(rec):
            logits = forward()
        self._recorded[key] = (rec, logits, None)
        return logits

    def capture(self) -> dict:
        """Capture every recorded bucket not captured yet as a CUDA graph (nothing off a GPU).
        Call it on the thread that runs the steps."""
        if not self.use_graphs:
            return {"graphs": 0, "seconds": 0.0, "memory_mib": 0.0}
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return capture(self._recorded, self.device, self._graph_pool)

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in self._pools.values() for t in pool)
