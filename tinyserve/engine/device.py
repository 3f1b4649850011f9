"""Device selection, and the Triton interpreter switch that must precede any kernel import."""

from __future__ import annotations

import os
import sys


def select_device(requested: str | None = None) -> str:
    """Pick cuda when present; on the CPU run kernels through Triton's interpreter.

    TRITON_INTERPRET is read when @triton.jit decorates a kernel, so it must be set before
    tinyserve.kernels is first imported; after that it is too late to change.
    """
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device")
    interpret = device == "cpu"
    if "tinyserve.kernels" in sys.modules:
        if interpret != (os.environ.get("TRITON_INTERPRET") == "1"):
            raise RuntimeError(
                f"tinyserve.kernels was imported with TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET', 'unset')}, which does not fit device "
                f"{device!r}; select the device before importing the kernels")
    elif interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        # numpy's threads inside the interpreter's tl.dot made tiny steps 2-3x slower.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    return device
