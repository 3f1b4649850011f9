"""The Triton and torch under test are ones pyproject.toml supports, and what
``kernels/interpreter.py`` changes in Triton's CPU interpreter behaves as a GPU does: a scalar
argument used as a loop bound (Triton 3.6 with numpy >= 2.4 refused it), fp32 -> bf16 casts
rounding to nearest even. The last test watches the interpreter's bf16 math, which the kernel
tests skip (tests/kernels/dtypes.py): it fails once a Triton gets it right.
"""

import os
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from packaging.requirements import Requirement

from tests.kernels.dtypes import BF16_MATH, INTERPRETED
from tinyserve.kernels import matmul

ROOT = Path(__file__).parents[2]


def test_torch_and_triton_are_in_the_supported_range():
    """.ci/run's Triton 3.6 step also sets TINYSERVE_EXPECT_TRITON: its PYTHONPATH really won."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for module in (torch, triton):
        req = next(Requirement(d) for d in deps if Requirement(d).name == module.__name__)
        assert req.specifier.contains(module.__version__, prereleases=True), (
            f"{module.__name__} {module.__version__} is outside pyproject's {req}")
    want = os.environ.get("TINYSERVE_EXPECT_TRITON")
    assert want is None or triton.__version__ == want, (triton.__version__, triton.__file__)


@triton.jit
def _sum_in_chunks_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):  # a runtime bound: the interpreter calls tensor.__index__
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_a_scalar_argument_bounds_a_loop(device):
    x = torch.arange(100, dtype=torch.float32, device=device)
    out = torch.zeros(1, device=device)
    with warnings.catch_warnings():  # numpy 1.25 - 2.3 warn where 2.4 refuses
        warnings.simplefilter("error", DeprecationWarning)
        _sum_in_chunks_kernel[(1,)](x, out, 100, BLOCK=16)
    assert out.item() == 4950.0


@triton.jit
def _to_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x.to(tl.bfloat16), mask=offs < n)


def test_fp32_to_bf16_rounds_to_nearest_even(device):
    """Bit for bit as torch (and a GPU's cvt.rn.bf16.f32): ties to even both ways, carries into
    the exponent, the largest finite values to inf, signs; NaN stays NaN (subnormals left out:
    whether a GPU flushes them is not what this checks)."""
    ulp = 2.0 ** -7  # of bf16 in [1, 2)
    ties = [1 + ulp / 2, 1 + 3 * ulp / 2, 2 - ulp / 2, -(1 + ulp / 2)]
    near = [1 + ulp / 2 + 2.0 ** -20, 1 + ulp / 2 - 2.0 ** -20, 3.4e38, -3.4e38, 3.3e38]
    x = torch.cat([torch.tensor(ties + near + [0.0, -0.0, float("inf"), float("nan")]),
                   torch.randn(200, generator=torch.Generator().manual_seed(0)) * 100])
    out = torch.empty(len(x), dtype=torch.bfloat16, device=device)
    _to_bf16_kernel[(1,)](x.to(device), out, len(x), BLOCK=256)
    want = x.to(torch.bfloat16)
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's bf16 math (on a GPU the kernel "
                    "tests check bf16 themselves)")
@pytest.mark.xfail(strict=True, reason=BF16_MATH)
def test_bf16_math_is_still_wrong_in_the_interpreter():
    """Expected to fail: if this passes, the interpreter's bf16 tl.dot is right, and the bf16
    cases tests/kernels/dtypes.py skips under it (math=True) can run on the CPU."""
    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    got = matmul(a.bfloat16(), w.bfloat16()).float()
    torch.testing.assert_close(got, a.bfloat16().float() @ w.bfloat16().float().T,
                               atol=5e-2, rtol=1.6e-2)
