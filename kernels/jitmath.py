"""Device-side math shared by several kernels, written from exp so that Triton's interpreter
runs it too (``triton.language.extra.libdevice`` is not in the interpreter)."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: nothing overflows; absolute error
    ~1e-7 (fp32) near 0, where 1 - e cancels."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap(x, cap):
    """Gemma's logit soft-capping: cap * tanh(x / cap)."""
    return cap * tanh(x / cap)
