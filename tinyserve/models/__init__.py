"""Models that ship with tinyserve (package data), one it fetches on request, and where
fetched and generated models are kept."""

import os
from pathlib import Path

STORIES260K = Path(__file__).resolve().parent / "stories260k"
SMOLLM2 = "smollm2"  # --model smollm2: SmolLM2-135M-Instruct, fetched on first use (smollm2.py)


def default_cache_dir() -> Path:
    """$TINYSERVE_CACHE, else $XDG_CACHE_HOME/tinyserve (~/.cache/tinyserve)."""
    root = os.environ.get("TINYSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tinyserve")
    return Path(root)
