"""The served models: ``--model`` values (``DIR``, ``NAME=DIR,option=value``) into one
ModelSpec each, with the KV budget split between them and the weights of the models still to
load reserved. Pure Python (no torch)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tinyserve.cli.values import NAME_PATTERN
from tinyserve.config import EngineConfig, ModelSpec
from tinyserve.formats.gguf import GGUFError, GGUFFile, held_bytes, is_gguf

MODEL_OPTIONS = ("quantization", "kv_cache_dtype", "kv_share", "max_model_len")


def parse_model_arg(text: str) -> tuple[str | None, str, dict[str, str]]:
    """``--model`` values: ``DIR``, ``NAME=DIR``, or ``NAME=DIR,option=value,...`` with options
    quantization (int8, int4), kv_cache_dtype (auto, int8), kv_share (0-1: this model's share
    of the KV budget) and
    max_model_len. DIR ``stories260k`` is the bundled model."""
    name, sep, rest = text.partition("=")
    if not sep or "/" in name or not NAME_PATTERN.match(name) or Path(text).exists():
        return None, text, {}  # a bare directory (which may itself contain '=' or ',')
    path, *opts = rest.split(",")
    options = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in MODEL_OPTIONS:
            raise ValueError(f"--model {text}: unknown option {opt!r} (options: "
                             f"{', '.join(MODEL_OPTIONS)})")
        options[key] = value
    if not path:
        raise ValueError(f"--model {text}: no model directory after '='")
    return name, path, options


def build_models(base: EngineConfig, model_args: list[str] | tuple[str, ...],
                 served_model_name: str | None = None) -> tuple[ModelSpec, ...]:
    """The served models: ``base`` holds the shared options, each --model its own.

    KV budget: an explicit --num-kv-blocks / --kv-cache-memory is the total, split by
    kv_share; models without kv_share split what the others leave equally. Sized from free
    memory, each model takes its share of what is left when it loads, after reserving the
    weights of the models still to load."""
    if not model_args:
        name = served_model_name or _model_name(base.resolved_model)
        return (ModelSpec(name, base),)
    parsed = [parse_model_arg(a) for a in model_args]
    if served_model_name and len(parsed) > 1:
        raise ValueError("--served-model-name names one model; with several, use --model NAME=DIR")
    specs: list[tuple[str, str, dict[str, str]]] = []
    for name, path, options in parsed:  # (NAME= is checked; any other name is as given)
        name = name or served_model_name or _model_name(path)
        specs.append((name, path, options))
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two models are served as one name: {names}")
    shares: list[float | None] = []
    for name, _, options in specs:
        share = options.get("kv_share")
        try:
            shares.append(None if share is None else float(share))
        except ValueError:
            raise ValueError(f"model {name}: kv_share must be a number, got {share!r}") from None
    given = sum(s for s in shares if s is not None)
    if any(s is not None and not 0 < s <= 1 for s in shares) or given > 1 + 1e-9:
        raise ValueError(f"kv_share: each in (0, 1], together at most 1; got {shares}")
    unset = shares.count(None)
    if unset and given >= 1:
        raise ValueError("kv_share: the models that set one leave nothing for the others")
    resolved = [s if s is not None else (1 - given) / unset for s in shares]
    out = []
    for i, ((name, path, options), share) in enumerate(zip(specs, resolved, strict=True)):
        fields: dict = {"model": path, "random_demo": False, "kv_share": share,
                        "kv_share_of_free": 1.0}
        if "quantization" in options:
            fields["quantization"] = options["quantization"] or None
        if "kv_cache_dtype" in options:
            fields["kv_cache_dtype"] = options["kv_cache_dtype"] or "auto"
        if "max_model_len" in options:
            try:
                fields["max_model_len"] = int(options["max_model_len"])
            except ValueError:
                raise ValueError(f"model {name}: max_model_len must be an integer") from None
        if base.num_kv_blocks is not None:
            fields["num_kv_blocks"] = max(1, int(base.num_kv_blocks * share + 1e-9))
        elif base.kv_cache_memory is not None:
            fields["kv_cache_memory"] = max(1, int(base.kv_cache_memory * share + 1e-9))
        else:
            left = 1 - sum(resolved[:i])
            fields["kv_share_of_free"] = min(1.0, share / max(left, share))
            fields["kv_reserve_bytes"] = sum(_weight_bytes(p, o) for _, p, o in specs[i + 1:])
        out.append(ModelSpec(name, dataclasses.replace(base, **fields)))
    return tuple(out)


def _model_name(path: str) -> str:
    """The name a model is served as by default: its directory's, or its GGUF file's stem."""
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


def _weight_bytes(path: str, options: dict[str, str]) -> int:
    """An upper bound on a checkpoint's weights in memory, from its safetensors headers: every
    tensor as stored, except that with quantization the decoder's projections count at their
    quantized size (int8: a byte a weight + an fp32 scale a row; int4: half a byte, K padded
    to the group, + a scale (fp32 at most) and a zero point a group); the embedding, the LM
    head and the norms stay float."""
    if is_gguf(path) and Path(path).exists():
        try:
            return held_bytes(GGUFFile(path))
        except GGUFError:
            return Path(path).stat().st_size  # the loader will say why
    quant = options.get("quantization") or None
    total = 0
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    for f in files:
        try:
            with f.open("rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        except (OSError, ValueError):
            total += f.stat().st_size  # unreadable here: the loader will say why
            continue
        for name, info in header.items():
            if name == "__metadata__":
                continue
            stored = info["data_offsets"][1] - info["data_offsets"][0]
            shape = info["shape"]
            if quant is None or len(shape) != 2 or not (".layers." in name
                                                        and name.endswith("proj.weight")):
                total += stored
            elif quant == "int8":
                total += min(stored, shape[0] * shape[1] + 4 * shape[0])
            else:  # int4, groups of 128
                groups = -(-shape[1] // 128)
                total += min(stored, shape[0] * groups * (64 + 5))
    return total
