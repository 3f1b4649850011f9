"""CUDA graphs of the decode buckets' recordings, captured together.

``torch.cuda.graph`` synchronizes, collects garbage and empties the allocator's cache for
every graph it captures (45 to 81 buckets x split classes: seconds of it), and captures in
the global mode, where any CUDA call from another thread aborts the capture. Here the whole
set is captured after one synchronize and one cleanup, into one memory pool, on a side
stream, with capture errors local to the capturing thread.
"""

from __future__ import annotations

import gc
import time

import torch


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
