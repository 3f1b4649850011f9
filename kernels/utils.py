"""Launcher helpers shared by every kernel file: the interpreter flag, block-size math, checks."""

from __future__ import annotations

import os

import torch
import triton

# Read once, like @triton.jit does: it decides at decoration time whether kernels are interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs: exact "ieee" products (NVIDIA would silently use tf32); others: the default."""
    return "ieee" if dtype == torch.float32 else None


def check(cond: bool, msg: str) -> None:
    """Launcher-side validation: the interpreter does no bounds checking, so fail before launch."""
    if not cond:
        raise ValueError(msg)
