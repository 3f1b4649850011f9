"""GGUF files (llama.cpp's format), read without torch: the metadata, and each tensor's type,
shape and bytes as a read-only memory map (nothing is read until a tensor is asked for).

    magic "GGUF", version (2, 3), tensor count, metadata count      little endian
    metadata   key (string), value type, value                      arrays: type, count, items
    tensors    name, dims (ne0 = the row length first), ggml type, offset into the data
    data       at general.alignment (32) after the header

A model split by llama.cpp's gguf-split (``name-00001-of-00003.gguf``) is read as one: pass any
part; the metadata is the first part's, the tensors are all parts'.

Shared by the tokenizer (text/) and the weight loader (engine/); the GGML types' block layouts
and their conversion live in engine/gguf_weights.py.
"""

from __future__ import annotations

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


class _Cursor:
    def __init__(self, buf: memoryview | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.scalar(4), self.scalar(10)
            if item == 8:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:  # numbers in bulk (token types, scores)
                size = np.dtype(_NUMPY[item]).itemsize * count
                arr = np.frombuffer(self.take(size), dtype=_NUMPY[item])
                return arr.astype(bool).tolist() if item == 7 else arr.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind}")
        return self.scalar(kind)


def _read_header(path: Path, part: int) -> tuple[dict[str, Any], list[TensorInfo], mmap.mmap]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise GGUFError(f"{path}: {e.strerror}") from e
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise GGUFError(f"{path}: not a GGUF file (empty)") from e
    cur = _Cursor(memoryview(mm), path)
    if cur.take(4) != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cur.scalar(4)
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2, 3; a big-endian "
                        "file reads as a huge version)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar(4))
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
        raw.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in raw:
        if kind not in GGML_TYPES:
            raise GGUFError(f"{path}: tensor {name} has unknown ggml type {kind}")
        _, block, size = GGML_TYPES[kind]
        n = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name}: rows of {dims[0]} are not whole blocks of "
                            f"{block} ({GGML_TYPES[kind][0]})")
        info = TensorInfo(name, kind, tuple(reversed(dims)), part, start + offset,
                          n // block * size)
        if info.offset + info.nbytes > len(mm):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors.append(info)
    return meta, tensors, mm


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
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture is missing")
        return arch

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes, read-only, as uint8 (no copy: a view of the memory map)."""
        t = self.tensors[name]
        return np.frombuffer(self._maps[t.part], dtype=np.uint8, count=t.nbytes, offset=t.offset)


def held_bytes(f: GGUFFile) -> int:
    """About what the engine holds for the file's weights: each tensor in its kept form, and a
    quantized embedding twice (a float table to gather from, its codes as the tied head)."""
    total = 0.0
    for t in f.tensors.values():
        n = int(np.prod(t.shape))
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
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: a split model without its part(s) {', '.join(missing)}")
    return parts


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")
