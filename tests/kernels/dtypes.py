"""The kernel tests' dtypes: ``(dtype, atol, rtol)`` against a float32 torch reference, the same
on every device, and where bf16 can be checked.

A tolerance here must hold on a GPU (Triton compiled: fp32 ``tl.dot`` as "ieee", approximate
exp2 / rsqrt, FMA contraction, other reduction orders) as well as under the CPU interpreter, so
each is a few units in the last place of its dtype, never the interpreter's exact agreement:
fp16 steps are 2^-10 (~1e-3) of a value, bf16's 2^-7 (~8e-3), 8x coarser, so bf16 tolerances
are about 8x fp16's.

bf16 on the CPU: Triton's interpreter holds bf16 as raw uint16 bits and computes bf16
arithmetic, ``tl.dot`` on bf16 tiles and int -> bf16 casts on those bits
(triton-lang/triton#11584; measured: a bf16 ``matmul`` 1e11 off); loads, stores and casts
to and from fp32 are right (fp32 -> bf16 rounded to nearest by kernels/interpreter.py: Triton's
own truncates). So a kernel that upcasts right after its loads (row-wise kernels,
KV writes) runs its bf16 cases here too; one that does bf16 math (matmuls, attention, the
dequant-matmuls) has them skipped under the interpreter, with ``BF16_MATH``'s reason, and run on
a GPU. ``test_interpreter_compat.py`` fails once a Triton fixes that, so the skip can go.
"""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.utils import INTERPRET as INTERPRETED

BF16_MATH = ("bf16 tl.dot / arithmetic / int->bf16 casts are wrong in Triton's CPU interpreter "
             "(triton-lang/triton#11584): checked on a GPU")


def bf16(atol: float, rtol: float, math: bool = False):
    """A bf16 ``(dtype, atol, rtol)`` case; ``math``: the kernel computes in bf16 (a bf16
    ``tl.dot``, an int -> bf16 cast), so the case is skipped under the interpreter."""
    marks = pytest.mark.skipif(INTERPRETED and math, reason=BF16_MATH)
    return pytest.param(torch.bfloat16, atol, rtol, marks=marks, id="bf16")

