"""Single flag values parsed into configuration: sizes, --route, --fallback, --lora-modules
and --speculative-config. Each refusal is a ValueError naming the flag and the value."""

from __future__ import annotations

import json
import re

from tinyserve.config import SpeculativeConfig

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # served model names and aliases


def parse_size(text: str) -> int:
    """'8GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def parse_route(text: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``--route ALIAS=NAME:WEIGHT,NAME:WEIGHT``."""
    alias, sep, rest = text.partition("=")
    if not sep or not NAME_PATTERN.match(alias):
        raise ValueError(f"--route {text}: expected ALIAS=NAME:WEIGHT,NAME:WEIGHT")
    targets = []
    for part in rest.split(","):
        name, colon, weight = part.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not colon or not name or not w >= 0 or w == float("inf"):
            raise ValueError(f"--route {text}: {part!r} is not NAME:WEIGHT (weight >= 0)")
        targets.append((name, w))
    return alias, tuple(targets)


def parse_fallback(text: str) -> tuple[str, str]:
    """``--fallback NAME=OTHER``."""
    name, sep, other = text.partition("=")
    if not sep or not name or not other:
        raise ValueError(f"--fallback {text}: expected NAME=OTHER")
    return name, other


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """``--lora-modules`` values, as vLLM's: ``NAME=DIR``, or a JSON object with ``name``,
    ``path`` and ``base_model_name`` (several models: which one it adapts; None: the first)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text}: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or \
                not isinstance(d.get("path"), str) or set(d) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules {text}: expected {{\"name\": ..., \"path\": ..., "
                             "\"base_model_name\": ...}")
        return d["name"], d["path"], d.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text}: expected NAME=DIR")
    return name, path, None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'``."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("--speculative-config: expected a JSON object")
    fields = set(SpeculativeConfig.__dataclass_fields__)
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)} (known: "
                         f"{', '.join(sorted(fields))})")
    return SpeculativeConfig(**d)
