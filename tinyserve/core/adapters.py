"""LoRA adapters, torch-free: a PEFT directory read and checked against the base model
(``adapter_config.json`` and the safetensors header: every entry's dtype, shape and offsets
against each other and the file; the engine then reads and checks the data), and the registry of
the adapters a served model has: names, versions, the requests using each.

What a directory may hold (PEFT's names; anything else is refused naming it):

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o,qkv}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down,gate_up}_proj.lora_{A,B}.weight

    A: [r, in]   B: [out, r]   delta W = scale * B A,  scale = alpha / r  (rsLoRA: / sqrt(r))

Refused by name: DoRA, LoRA biases, fan_in_fan_out, modules_to_save, embedding / LM-head
adapters, per-module rank or alpha patterns, layer replication, and PEFT's other methods.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# module name -> (projection, slice): the slices of the model's fused projections (see
# engine/model/weights.py): qkv = [q | k | v], gate_up = [gate | up]; None: the whole projection
MODULES: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
    "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None), "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight$")
# config keys whose non-default value asks for something this server does not do
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "layer_replication": None, "use_qalora": False, "use_bdlora": None,
            "trainable_token_indices": None, "target_parameters": None,
            "alora_invocation_tokens": None, "arrow_config": None}
MAX_ADAPTER_NAME = 128


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The base model's projection sizes an adapter must fit."""

    num_layers: int
    hidden: int
    q_out: int  # num_heads * head_dim
    kv_out: int  # num_kv_heads * head_dim
    intermediate: int
    # layers whose feed-forward is a mixture of experts: no gate / up / down adapters there
    sparse_layers: frozenset[int] = frozenset()

    def slices(self, projection: str) -> list[int]:
        """The output widths of a projection's slices."""
        return {"qkv": [self.q_out, self.kv_out, self.kv_out], "o": [self.hidden],
                "gate_up": [self.intermediate, self.intermediate], "down": [self.hidden]}[projection]

    def in_width(self, projection: str) -> int:
        return {"qkv": self.hidden, "o": self.q_out, "gate_up": self.hidden,
                "down": self.intermediate}[projection]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One loaded adapter: where its weights are and what they hold."""

    name: str
    path: str  # the PEFT directory
    adapter_id: int  # unique per load: a reloaded name is a new adapter (cache salt, slots)
    rank: int
    scale: float  # alpha / r (rsLoRA: alpha / sqrt(r))
    modules: tuple[str, ...]  # the PEFT module names it targets (q_proj, ...)

    @property
    def cache_salt(self) -> bytes:
        """Appended to the tenant's: prefix-cache blocks are never shared across adapters or
        with the base model."""
        return b"\0lora:%d" % self.adapter_id


MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json
MAX_HEADER_BYTES = 100 << 20  # the safetensors header (JSON)
MAX_PATH_CHARS = 4096
MAX_SCALE = 1e4  # |alpha / r|: real adapters sit within 0.1-64
_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # what a LoRA weight may be stored as


def read_adapter(path: str | Path, dims: ModelDims, max_rank: int, name: str = "",
                 adapter_id: int = 0) -> AdapterSpec:
    """A PEFT LoRA directory checked against the base model; ValueError naming what does not
    fit (the message is the client's, for load_lora_adapter). Reads the config and the
    safetensors header only: the engine reads and checks the weights (AdapterRegistry)."""
    if not isinstance(path, (str, Path)) or not 0 < len(str(path)) <= MAX_PATH_CHARS \
            or "\0" in str(path):
        raise ValueError(f"lora_path must be a path of 1 to {MAX_PATH_CHARS} characters "
                         "without NUL bytes")
    d = Path(path)
    cfg_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    try:
        found_files = cfg_file.is_file() and weights.is_file()
    except OSError as e:  # a name too long for the file system, a loop of links, ...
        raise ValueError(f"{path}: {e.strerror or e}") from None
    if not found_files:
        raise ValueError(f"{path}: not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors)")
    cfg = _read_config(cfg_file)
    r, scale = _rank_and_scale(cfg, cfg_file, max_rank)
    found = _lora_shapes(weights, dims)
    for (layer, module), shapes in found.items():
        projection, part = MODULES[module]
        widths = dims.slices(projection)
        out = sum(widths) if part is None else widths[part]
        want = {"A": [r, dims.in_width(projection)], "B": [out, r]}
        for ab in "AB":
            if shapes.get(ab) != want[ab]:
                raise ValueError(f"{path}: layer {layer} {module} lora_{ab} has shape "
                                 f"{shapes.get(ab)}, the model needs {want[ab]}")
    modules = tuple(sorted({module for _, module in found}))
    return AdapterSpec(name, str(d), adapter_id, r, scale, modules)


def _read_config(cfg_file: Path) -> dict:
    """adapter_config.json: a JSON object of at most MAX_CONFIG_BYTES, asking for plain LoRA."""
    try:
        with cfg_file.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(text)
    except RecursionError:
        raise ValueError(f"{cfg_file}: nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {str(cfg.get('peft_type'))[:64]!r} is not "
                         "supported (LORA is)")
    if cfg.get("target_parameters"):  # (PEFT's LoRA on parameters: a MoE's stacked experts)
        raise ValueError(f"{cfg_file}: target_parameters={str(cfg['target_parameters'])[:64]}: "
                         "adapters on expert weights are not supported (on attention they are)")
    for key, default in _REFUSED.items():
        value = cfg.get(key, default)
        if value not in (default, None, False, {}, []) and value != default:
            raise ValueError(f"{cfg_file}: {key}={str(value)[:64]} is not supported")
    return cfg


def _rank_and_scale(cfg: dict, cfg_file: Path, max_rank: int) -> tuple[int, float]:
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{cfg_file}: r must be a positive integer, got {str(r)[:64]}")
    if r > max_rank:
        raise ValueError(f"{cfg_file}: rank {r} is more than --max-lora-rank ({max_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha):
        raise ValueError(f"{cfg_file}: lora_alpha must be a finite number, got "
                         f"{str(alpha)[:64]}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError(f"{cfg_file}: use_rslora must be true or false")
    scale = alpha / (math.sqrt(r) if use_rslora else r)
    if not abs(scale) <= MAX_SCALE:
        raise ValueError(f"{cfg_file}: lora_alpha {alpha:g} scales the adapter by {scale:g}; "
                         f"at most {MAX_SCALE:g} is taken")
    return r, float(scale)


def _lora_shapes(weights: Path, dims: ModelDims) -> dict[tuple[int, str], dict[str, list[int]]]:
    """(layer, module) -> {"A": shape, "B": shape} from the header, every entry checked."""
    header, data_bytes = _safetensors_header(weights)
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        m = _KEY.match(key)
        if m is None:
            what = "an expert's" if ".experts." in key or "shared_expert" in key else "its"
            raise ValueError(f"{weights}: tensor {key[:120]!r}: {what} adapter is not supported "
                             f"(only the decoder layers' {', '.join(MODULES)} ones are)")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if module not in MODULES:
            raise ValueError(f"{weights}: tensor {key}: module {module!r} is not supported")
        if layer >= dims.num_layers:
            raise ValueError(f"{weights}: tensor {key}: layer {layer} is beyond the model's "
                             f"{dims.num_layers}")
        if layer in dims.sparse_layers and MODULES[module][0] in ("gate_up", "down"):
            raise ValueError(f"{weights}: tensor {key}: layer {layer}'s feed-forward is a "
                             "mixture of experts; adapters on expert weights are not supported "
                             "(on its attention they are)")
        found.setdefault((layer, module), {})[ab] = _entry_shape(weights, key, info, data_bytes)
    if not found:
        raise ValueError(f"{weights}: the adapter holds no LoRA weights")
    end = max(info["data_offsets"][1] for key, info in header.items() if key != "__metadata__")
    if end < data_bytes:  # (a sparse file of gigabytes behind a small header)
        raise ValueError(f"{weights}: {data_bytes - end} bytes after the last tensor's data")
    return found


def _entry_shape(weights: Path, key: str, info: object, data_bytes: int) -> list[int]:
    """A header entry's shape, once its dtype, shape and offsets agree with each other and
    with the file (a tensor that cannot be read whole is refused here, not at first use)."""
    if not isinstance(info, dict):
        raise ValueError(f"{weights}: tensor {key}: the header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{weights}: tensor {key}: dtype {str(dtype)[:32]} is not a float "
                         f"type ({', '.join(_DTYPES)})")
    if not (isinstance(shape, list) and len(shape) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 31 for n in shape)):
        raise ValueError(f"{weights}: tensor {key}: shape {str(shape)[:64]} is not two "
                         "positive sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) for n in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise ValueError(f"{weights}: tensor {key}: data_offsets {str(offsets)[:64]} are not "
                         f"within the file's {data_bytes} bytes of data")
    if offsets[1] - offsets[0] != shape[0] * shape[1] * _DTYPES[dtype]:
        raise ValueError(f"{weights}: tensor {key}: data_offsets span {offsets[1] - offsets[0]}"
                         f" bytes, its shape and dtype {shape[0] * shape[1] * _DTYPES[dtype]}")
    return shape


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(the header, the bytes of data after it)."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
            data_bytes = path.stat().st_size - 8 - size
    except RecursionError:
        raise ValueError(f"{path}: not a safetensors file: its header is nested too "
                         "deeply") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a safetensors file: {e}") from None
    if not isinstance(header, dict) or data_bytes < 0:
        raise ValueError(f"{path}: not a safetensors file")
    return header, data_bytes


class AdapterRegistry:
    """The adapters served on one base model, by name. The API resolves names and counts the
    requests using each (an unload waits for them); the batcher's slots take paths from it.
    Lives on the event loop: one owner, no locks."""

    def __init__(self, base_model: str, dims: ModelDims, max_rank: int,
                 reader: Callable[[AdapterSpec], None] | None = None) -> None:
        self.base_model = base_model
        self.dims, self.max_rank = dims, max_rank
        # The engine's: reads every weight, checks it (finite in the model's dtype) and keeps
        # it in host memory; ValueError refuses the load (None: header checks only)
        self._reader = reader
        self._by_name: dict[str, AdapterSpec] = {}
        self._unloading: set[str] = set()
        self.in_use: dict[str, int] = {}  # name -> requests running with it
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name and name not in self._unloading

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return [n for n in self._by_name if n not in self._unloading]

    def get(self, name: str) -> AdapterSpec | None:
        return None if name in self._unloading else self._by_name.get(name)

    def by_id(self, adapter_id: int) -> AdapterSpec | None:
        for spec in self._by_name.values():
            if spec.adapter_id == adapter_id:
                return spec
        return None

    def load(self, name: str, path: str) -> AdapterSpec:
        """Check and register an adapter (ValueError: why not). A name in use is refused:
        unload it first (no request ever sees a name change its weights)."""
        if not name or len(name) > MAX_ADAPTER_NAME or not re.fullmatch(r"[\w.:-]+", name):
            raise ValueError(f"lora_name must be 1-{MAX_ADAPTER_NAME} letters, digits or "
                             "'_.:-'")
        if name in self._by_name:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        spec = read_adapter(path, self.dims, self.max_rank, name, next(self._ids))
        if self._reader is not None:
            self._reader(spec)
        self._by_name[name] = spec
        return spec

    def start_unload(self, name: str) -> None:
        """New requests no longer see it; KeyError if there is no such adapter."""
        if name not in self._by_name or name in self._unloading:
            raise KeyError(name)
        self._unloading.add(name)

    def finish_unload(self, name: str) -> None:
        self._by_name.pop(name, None)
        self._unloading.discard(name)
        self.in_use.pop(name, None)

    def cancel_unload(self, name: str) -> None:
        self._unloading.discard(name)

    def acquire(self, name: str) -> None:
        self.in_use[name] = self.in_use.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self.in_use.get(name, 0) - 1
        if left > 0:
            self.in_use[name] = left
        else:
            self.in_use.pop(name, None)
