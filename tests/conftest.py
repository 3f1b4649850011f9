"""Test setup: run Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported (it is read when @triton.jit
decorates a function), so it is decided here, before the test modules import anything.
"""

import os
import shutil
from pathlib import Path

if os.environ.get("TINYSERVE_DEVICE", "") != "cuda":
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # control-plane tests need no torch
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
# numpy threads inside the interpreter's tl.dot make tiny steps slower, not faster.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tinyserve.models import STORIES260K as STORIES_DIR  # noqa: E402  (ships in the package)

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """The repo root must not be on sys.path: its kernels/ would stand in for an installed
    package of that name (transformers >= 5.25 imports Hugging Face's ``kernels``)."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin and Path(spec.origin).parent == ROOT / "kernels":
        raise pytest.UsageError(
            "the repository root is on sys.path, so its kernels/ shadows the installed "
            "`kernels` package: run `python -P -m pytest` or `pytest` (not `python -m pytest`)")


@pytest.fixture(scope="session")
def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return STORIES_DIR


@pytest.fixture(scope="session")
def tmp_models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, or a skip saying how to fetch it."""
    from tinyserve.models.smollm2 import smollm2_path

    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"{path} is missing: `python -m tinyserve.models.smollm2` fetches it "
                    "(.ci/run does)")
    return path
