"""The bitwise batch-invariance tests hold whichever BLAS kernel numpy's OpenBLAS picks.

On the CPU the interpreter computes ``tl.dot`` with numpy, and OpenBLAS chooses its kernels per
CPU at run time. Its Haswell/Zen gemm (AVX2 machines, AMD EPYC) rounds a row by its place in the
tile, which once made these tests pass on one machine and fail on the next;
``kernels/interpreter.py`` now computes every row of a dot with the same 1-row call. Here each
test reruns under several forced kernels (``OPENBLAS_CORETYPE``), in a subprocess because
OpenBLAS reads the variable once, at load. A core this CPU cannot run (e.g. SkylakeX without
AVX-512) crashes numpy at import: it is skipped.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
INVARIANCE_TESTS = [
    "tests/kernels/test_attention.py::test_chunked_prefill_equals_whole_prefill",
    "tests/kernels/test_attention.py::test_decode_single_split_rows_are_batch_invariant",
    "tests/kernels/test_attention.py::test_decode_rows_are_batch_invariant_across_sequence_slots",
    "tests/kernels/test_matmul.py::test_matmul_rows_are_batch_invariant",
]
CORETYPES = ["Haswell", "Zen", "Sandybridge", "Prescott"]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="tl.dot runs on the GPU here, not through numpy's BLAS")


def _env(coretype: str) -> dict[str, str]:
    return {**os.environ, "OPENBLAS_CORETYPE": coretype, "OPENBLAS_NUM_THREADS": "1"}


@functools.cache
def _runs_here(coretype: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=_env(coretype),
                           capture_output=True, timeout=60)
    return probe.returncode == 0


@pytest.mark.parametrize("coretype", CORETYPES)
def test_batch_invariance_is_bitwise_under_each_blas_kernel(coretype):
    if not _runs_here(coretype):
        pytest.skip(f"OPENBLAS_CORETYPE={coretype} crashes numpy on this CPU")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INVARIANCE_TESTS],
        env=_env(coretype), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"OPENBLAS_CORETYPE={coretype}:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
    assert f"{len(INVARIANCE_TESTS)} passed" in out.stdout, out.stdout[-2000:]
