"""The Python packages the H200 device image lacks, carried there as wheels.

    python loadtest/gpu/wheels.py --check     # every runtime dependency is there or carried
    python loadtest/gpu/wheels.py --specs     # NAME==VERSION for prepare.sh's pip download

The device (kind ``nvidia-h200``) has no network: tinyserve's runtime dependencies
(pyproject.toml) that its image does not hold travel as wheels for CPython 3.12 on
manylinux x86_64 (prepare.sh downloads them here, check.py installs them there with
``--no-index``). ``ON_DEVICE`` is the image's package list as the device tool's KINDS.md gives
it (read 2026-11-17); a dependency added to pyproject.toml that is neither there nor in
``WHEELS`` fails ``--check`` (and prepare.sh, and tests/loadtest/test_gpu_check_dry_run.py).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ".gpu-wheels"  # in the repo root, ignored by git, carried to the device

# Missing on the device image: the versions this repository's CI environment runs.
WHEELS = {"msgspec": "0.23.0", "llguidance": "1.9.1"}

# How each runtime dependency is imported (check.py imports every one there).
IMPORT_NAMES = {"prometheus-client": "prometheus_client", "jinja2": "jinja2"}

ON_DEVICE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def runtime_dependencies() -> list[str]:
    """pyproject.toml's [project].dependencies as normalized names (all apply on Linux)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [_name(d) for d in deps]


def uncovered() -> list[str]:
    """Runtime dependencies neither on the device image nor carried as wheels."""
    return [d for d in runtime_dependencies() if d not in ON_DEVICE and d not in WHEELS]


def import_names() -> list[str]:
    return [IMPORT_NAMES.get(d, d.replace("-", "_")) for d in runtime_dependencies()]


def main(argv: list[str]) -> int:
    if "--specs" in argv:
        print(" ".join(f"{k}=={v}" for k, v in WHEELS.items()))
        return 0
    missing = uncovered()
    if missing:
        print(f"not on the device image and not in loadtest/gpu/wheels.py WHEELS: {missing}")
        return 1
    carried = [d for d in runtime_dependencies() if d in WHEELS]
    print(f"runtime dependencies: {len(runtime_dependencies())}; carried as wheels: {carried}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
