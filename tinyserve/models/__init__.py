"""Models that ship with tinyserve (package data)."""

from pathlib import Path

STORIES260K = Path(__file__).resolve().parent / "stories260k"
