"""GGUF files (llama.cpp's format), read without torch: the metadata, and each tensor's type,
shape and bytes as a read-only memory map (nothing is read until a tensor is asked for).

    magic "GGUF", version (2, 3), tensor count, metadata count      little endian
    metadata   key (string), value type, value                      arrays: type, count, items
    tensors    name, dims (ne0 = the row length first), ggml type, offset into the data
    data       at general.alignment (32) after the header

The file is untrusted input (llama.cpp's and Ollama's readers of it have had CVEs): every count
and size is bounded by the bytes left in the file before anything is allocated, what the parsed
header holds in Python objects by HEADER_BUDGET (a 40 MB array of u16 took 930 MB as a list),
and nesting, dims and elements by the limits below. A refusal names the file and the key or
tensor being read; the typed getters (``get``, ``items``, ``token_id``) refuse a value of the
wrong kind or range by name, so consumers never meet a string where a count belongs.

A model split by llama.cpp's gguf-split (``name-00001-of-00003.gguf``) is read as one: pass any
part; the metadata is the first part's, the tensors are all parts'.

Shared by the tokenizer (text/) and the weight loader (engine/); the GGML types' block layouts
and their conversion live in engine/gguf_weights.py.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ggml type -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
# bytes per weight as the engine holds each type (engine/gguf_quants.py: int4 codes with fp16
# or fp32 scales and mins, int8 codes; floats at 2 bytes, a half type on a GPU)
HELD_BYTES_PER_WEIGHT = {"Q4_0": 0.5625, "Q4_1": 0.625, "Q4_K": 0.75, "Q5_0": 1.0625,
                         "Q5_1": 1.125, "Q5_K": 1.25, "Q6_K": 1.25, "Q8_0": 1.0625,
                         "F16": 2.0, "BF16": 2.0, "F32": 2.0}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# The limits (llama.cpp's own where it has one)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # a tensor name's bytes (GGML_MAX_NAME 64, with its NUL)
MAX_ELEMENTS = 1 << 48  # a tensor's (the largest real ones hold ~2^30)
MAX_KEYS = 1 << 16  # metadata keys (real files: under 100)
MAX_ARRAY_DEPTH = 2  # an array of arrays; no real file nests at all
# What the parsed header may hold in Python objects. NOTE: Gemma 3's 262k-token vocabulary (its
# tokens, scores and types) counts ~55 MiB here, the largest real header we know of.
HEADER_BUDGET = 256 << 20
# Upper bounds of what Python holds per item: a list slot and a number (8 + 24..36 bytes); a
# str or a list (8 + 49..82 bytes, and a str at most 2 bytes a character for each byte of
# UTF-8); a TensorInfo with its shape, name and dict slot
_PY_ITEM, _PY_STR, _PY_TENSOR = 48, 88, 512
# the fewest bytes each value type takes in the file (an array: its item type and count)
_FILE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: 8, 9: 12, 10: 8, 11: 8, 12: 8}
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # name length, dims count, one dim, type, offset
SPECIAL_TOKENS = ("bos", "eos", "eot", "eom", "padding", "unknown")  # tokenizer.ggml.{}_token_id


class GGUFError(ValueError):
    """A file that is not a GGUF tinyserve can read; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # [rows, row length]: numpy order (GGUF lists ne0 = the row first)
    part: int  # which file of a split model
    offset: int  # from the start of that file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]


def show(value: Any) -> str:
    """A metadata value for an error message: short, whatever the file holds."""
    if isinstance(value, list):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Cursor:
    """The header, front to back; ``where`` names the key or tensor being read, and ``budget``
    what its Python objects may still take."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path
        self.where, self.budget = "header", HEADER_BUDGET

    def error(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path}: {self.where}: {why}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> bytes:
        if n > self.left():
            raise self.error(f"truncated ({n} bytes wanted, {self.left()} left)")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def bound(self, count: int, file_bytes: int, py_bytes: int, what: str) -> None:
        """``count`` items of at least ``file_bytes`` each fit in the bytes left, and their
        Python objects (``py_bytes`` each) in the budget: checked before any is read."""
        if count * file_bytes > self.left():
            raise self.error(f"truncated: {count} {what} need at least {count * file_bytes} "
                             f"bytes, {self.left()} left")
        self.charge(count * py_bytes)

    def charge(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise self.error(f"the header holds more than {HEADER_BUDGET >> 20} MiB of "
                             "metadata (tinyserve's limit; real files hold a few)")

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int | None = None) -> str:
        n = self.scalar(10)
        if limit is not None and n > limit:
            raise self.error(f"a name of {n} bytes (at most {limit})")
        self.bound(n, 1, 2, "bytes of a string")
        self.charge(_PY_STR)
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            return self.array(depth + 1)
        if kind not in _SCALARS:
            raise self.error(f"unknown value type {kind}")
        return self.scalar(kind)

    def array(self, depth: int) -> list:
        item, count = self.scalar(4), self.scalar(10)
        if item not in _FILE_BYTES:
            raise self.error(f"an array of unknown value type {item}")
        if item == 9 and depth >= MAX_ARRAY_DEPTH:
            raise self.error(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        self.bound(count, _FILE_BYTES[item], _PY_STR if item in (8, 9) else _PY_ITEM,
                   "array items")
        if item in _NUMPY:  # numbers in bulk (token types, scores)
            arr = np.frombuffer(self.take(_FILE_BYTES[item] * count), dtype=_NUMPY[item])
            return arr.astype(bool).tolist() if item == 7 else arr.tolist()
        if item == 8:
            return self.strings(count)
        return [self.value(item, depth) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """An array's strings (the bulk of a header: tokens, merges), their objects charged
        already; each length checked against the bytes left before it is read."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            n = struct.unpack_from("<Q", buf, pos)[0] if pos + 8 <= end else end
            if n > end - pos - 8:
                self.pos = pos
                raise self.error(f"truncated: string {len(out)} of {count} runs past the end")
            out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.charge(2 * (pos - self.pos))  # (a character can take 2 bytes for each UTF-8 byte)
        self.pos = pos
        return out


def _map(path: Path) -> mmap.mmap:
    try:
        f = path.open("rb")
    except OSError as e:
        raise GGUFError(f"{path}: {e.strerror}") from e
    with f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise GGUFError(f"{path}: not a GGUF file (empty)") from e


def _read_header(path: Path, part: int) -> tuple[dict[str, Any], list[TensorInfo], mmap.mmap]:
    mm = _map(path)
    cur = _Cursor(memoryview(mm), path)
    try:
        meta, raw = _read_entries(cur)
        start = _data_start(meta, cur.pos, path)
        tensors = [_tensor_info(path, part, len(mm), start, *r) for r in raw]
    except GGUFError:
        cur.buf.release()
        mm.close()
        raise
    cur.buf.release()
    return meta, tensors, mm


def _read_entries(cur: _Cursor) -> tuple[dict[str, Any], list[tuple]]:
    """(metadata, [(name, dims, type, offset)]): the header as the file gives it."""
    if cur.take(4) != b"GGUF":
        raise GGUFError(f"{cur.path}: not a GGUF file (no GGUF magic)")
    version = cur.scalar(4)
    if version not in (2, 3):
        raise GGUFError(f"{cur.path}: GGUF version {version} is not supported (2, 3; a "
                        "big-endian file reads as a huge version)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    if n_kv > MAX_KEYS:
        raise cur.error(f"{n_kv} metadata keys (at most {MAX_KEYS})")
    least = n_kv * _MIN_KV + n_tensors * _MIN_TENSOR
    if least > cur.left():
        raise cur.error(f"truncated: {n_kv} keys and {n_tensors} tensors need at least {least} "
                        f"bytes, {cur.left()} left")
    cur.charge(n_kv * _PY_ITEM + n_tensors * _PY_TENSOR)
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        cur.where = f"metadata key #{i}"
        key = cur.string()
        cur.where = f"metadata key {show(key)}"
        if key in meta:
            raise cur.error("appears twice")
        meta[key] = cur.value(cur.scalar(4))
    raw = []
    for i in range(n_tensors):
        cur.where = f"tensor #{i}"
        name = cur.string(limit=MAX_NAME)
        cur.where = f"tensor {name}"
        n_dims = cur.scalar(4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"{n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [cur.scalar(10) for _ in range(n_dims)]
        raw.append((name, dims, cur.scalar(4), cur.scalar(10)))
    return meta, raw


def _data_start(meta: dict[str, Any], end: int, path: Path) -> int:
    """Where the tensor data begins: the header's end, rounded up to general.alignment."""
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment is {show(align)}: it must be a positive "
                        "power of two")
    return -(-end // align) * align


def _tensor_info(path: Path, part: int, file_size: int, start: int, name: str,
                 dims: list[int], kind: int, offset: int) -> TensorInfo:
    if kind not in GGML_TYPES:
        raise GGUFError(f"{path}: tensor {name} has unknown ggml type {kind}")
    type_name, block, size = GGML_TYPES[kind]
    if min(dims) < 1:
        raise GGUFError(f"{path}: tensor {name} has dims {dims}: each must be at least 1")
    n = math.prod(dims)  # (Python ints: no wrap-around to check for, only the size)
    if n > MAX_ELEMENTS:
        raise GGUFError(f"{path}: tensor {name} has {n} elements (dims {dims}; at most 2^48)")
    if dims[0] % block:
        raise GGUFError(f"{path}: tensor {name}: rows of {dims[0]} are not whole blocks of "
                        f"{block} ({type_name})")
    info = TensorInfo(name, kind, tuple(reversed(dims)), part, start + offset, n // block * size)
    if info.offset + info.nbytes > file_size:
        raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
    return info


class GGUFFile:
    """One model's GGUF file(s): ``metadata``, ``tensors`` (name -> TensorInfo) and ``data``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.paths = split_parts(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: list[mmap.mmap] = []
        for part, p in enumerate(self.paths):
            meta, tensors, mm = _read_header(p, part)
            if part == 0:
                self.metadata = meta
            self._maps.append(mm)
            for t in tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{p}: tensor {t.name} appears twice")
                self.tensors[t.name] = t
        self.path = self.paths[0]

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture", str)
        if arch is None:
            raise GGUFError(f"{self.path}: general.architecture is missing")
        return arch

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """metadata[key] (``default`` if absent) if it is a ``kind``, else a GGUFError naming
        the key and the value (a bool is no number here: int means a true integer)."""
        value = self.metadata.get(key, default)
        if value is not None and not _is(value, kind):
            raise GGUFError(f"{self.path}: {key} is {show(value)}, expected {_kinds(kind)}")
        return value

    def items(self, key: str, kind: type | tuple[type, ...]) -> list | None:
        """An array of ``kind`` items (None if absent), else a GGUFError naming the key."""
        value = self.metadata.get(key)
        if value is not None and not (isinstance(value, list)
                                      and all(_is(v, kind) for v in value)):
            raise GGUFError(f"{self.path}: {key} is {show(value)}, expected an array of "
                            f"{_kinds(kind, plural=True)}")
        return value

    def token_id(self, name: str, vocab: int) -> int | None:
        """tokenizer.ggml.{name}_token_id (None if absent), refused unless it is one of the
        ``vocab`` ids: an id past the table would fault every step that masks it."""
        key = f"tokenizer.ggml.{name}_token_id"
        i = self.get(key, int)
        if i is not None and not 0 <= i < vocab:
            raise GGUFError(f"{self.path}: {key} is {i}, outside the vocabulary of {vocab} "
                            "tokens")
        return i

    def special_ids(self, vocab: int) -> dict[str, int]:
        """Every special token id the file sets (SPECIAL_TOKENS), each range-checked."""
        ids = {name: self.token_id(name, vocab) for name in SPECIAL_TOKENS}
        return {name: i for name, i in ids.items() if i is not None}

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes, read-only, as uint8 (no copy: a view of the memory map)."""
        t = self.tensors[name]
        return np.frombuffer(self._maps[t.part], dtype=np.uint8, count=t.nbytes, offset=t.offset)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def _kinds(kind: type | tuple[type, ...], plural: bool = False) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: ("an integer", "integers"), float: ("a number", "numbers"),
             str: ("a string", "strings"), bool: ("a bool", "bools")}
    return " or ".join(names.get(k, (k.__name__,) * 2)[plural] for k in kinds)


def held_bytes(f: GGUFFile) -> int:
    """About what the engine holds for the file's weights: each tensor in its kept form, and a
    quantized embedding twice (a float table to gather from, its codes as the tied head)."""
    total = 0.0
    for t in f.tensors.values():
        n = math.prod(t.shape)
        total += n * HELD_BYTES_PER_WEIGHT.get(t.type_name, 2.0)
        if t.name == "token_embd.weight" and t.type_name not in ("F16", "BF16", "F32"):
            total += 2 * n
    return int(total)


def split_parts(path: Path) -> list[Path]:
    """All parts of a split model, in order (the file alone if it is not split)."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise GGUFError(f"{path}: part {int(m['no'])} of {count}: not a part of a split model")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: a split model without its part(s) {', '.join(missing)}")
    return parts


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")
