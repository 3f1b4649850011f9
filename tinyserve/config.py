"""Frozen, validated configuration. Pure Python (no torch): the control plane imports it.

Validation errors name the bad field, so CLI and API users see which knob is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to load a model and size its KV cache and batches."""

    model: str | None = None  # a Hugging Face model directory; None: the built-in demo model
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's fp16/bf16 on GPU
    quantization: str | None = None  # "int8": weight-only, per output channel
    device: str | None = None  # "cuda" / "cpu"; None: cuda if available
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV capacity in blocks ...
    kv_cache_memory: int | None = None  # ... or in bytes; neither: sized from free memory
    gpu_memory_utilization: float = 0.90  # share of the GPU's free memory the KV cache may take
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (chunked prefill budget)
    max_model_len: int | None = None  # prompt + output limit; None: the model's own
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds unseeded requests, reproducibly per engine

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks and kv_cache_memory are exclusive: give one")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
