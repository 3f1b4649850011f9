"""Launcher helpers shared by every kernel file: the interpreter flag, block-size math, checks."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read once, like @triton.jit does: it decides at decoration time whether kernels are interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Torch dtype -> Triton dtype for the few places a launcher passes one as a constexpr.
TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs: exact "ieee" products (NVIDIA would silently use tf32); others: the default."""
    return "ieee" if dtype == torch.float32 else None


def check(cond: bool, msg: str) -> None:
    """Launcher-side validation: the interpreter does no bounds checking, so fail before launch."""
    if not cond:
        raise ValueError(msg)


def check_same_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    check(all(t.device == dev for t in tensors), "all tensors must be on the same device")
