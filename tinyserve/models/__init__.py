"""Models that ship with tinyserve (package data), and one it fetches on request."""

from pathlib import Path

STORIES260K = Path(__file__).resolve().parent / "stories260k"
SMOLLM2 = "smollm2"  # --model smollm2: SmolLM2-135M-Instruct, fetched on first use (smollm2.py)
