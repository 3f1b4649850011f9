"""GGML block formats -> the group-wise forms the kernels multiply by, exactly (numpy, whole
tensors at once: no Python loop over blocks).

    GGUF type   block                                  kept as (kernels/group_matmul.py)
    Q8_0        32: fp16 d, 32 int8 q                 int8 codes q, scale d, group 32
    Q4_0        32: fp16 d, 32 nibbles                int4 codes, zero 8, scale d, group 32
    Q4_1        32: fp16 d, fp16 m, 32 nibbles        int4 codes, scale d, min m, group 32
    Q5_0        32: fp16 d, 32 high bits, nibbles     int8 codes q - 16, scale d, group 32
    Q5_1        32: d, m, high bits, nibbles          int8 codes q, scale d, min m, group 32
    Q4_K        256: fp16 d, dmin, 8 x 6-bit (sc, m), int4 codes, scale d * sc, min -dmin * m
                256 nibbles                           (fp32: exact), group 32
    Q5_K        Q4_K + 256 high bits                  int8 codes, as Q4_K
    Q6_K        256: 4 + 2 bits, 16 int8 scales, d    int8 codes q - 32, scale d * sc, group 16
    F32 / F16 / BF16                                  float

Every form is exact: its codes are the file's integers and its scales and mins the file's
values or their exact fp32 products (fp16 x 6-bit and fp16 x int8 need at most 19 bits).
Anything else (Q2_K, Q3_K, the IQ and TQ types, MXFP4) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(slots=True)
class Quantized:
    """Rows of a GGUF tensor in a kernel's form: W = codes * scales (+ mins), per group."""

    bits: int  # 4: codes in [0, 15] (uint8 here, packed at load); 8: int8 codes
    codes: np.ndarray  # [rows, K]
    scales: np.ndarray  # [rows, K / group] float16 or float32
    mins: np.ndarray | None  # [rows, K / group], or None (int4: zero point 8; int8: none)
    group: int

    def dequantize(self) -> np.ndarray:
        """The float32 W [rows, K] these stand for."""
        q = self.codes.astype(np.float32)
        if self.bits == 4 and self.mins is None:
            q -= 8.0
        w = q * np.repeat(self.scales.astype(np.float32), self.group, axis=1)
        if self.mins is not None:
            w += np.repeat(self.mins.astype(np.float32), self.group, axis=1)
        return w


def decode(kind: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray | Quantized:
    """A tensor's bytes -> float32 rows [rows, cols] (float types) or a Quantized form."""
    if kind == "F32":
        return raw.view("<f4").reshape(rows, cols).copy()  # (off the read-only memory map)
    if kind == "F16":
        return raw.view("<f2").reshape(rows, cols).astype(np.float32)
    if kind == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    if kind not in _DECODERS:
        raise ValueError(f"GGML type {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    block, size = _BLOCKS[kind]
    return _DECODERS[kind](raw.reshape(rows, cols // block, size), rows, cols)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block: [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view("<f2")[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: element j is byte j's low nibble, j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes, a little-endian uint32 -> [..., 32] bits, bit j for element j."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q8_0(b: np.ndarray, rows: int, cols: int) -> Quantized:
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, cols)
    return Quantized(8, codes, _f16(b, 0), None, 32)


def _q4_0(b: np.ndarray, rows: int, cols: int) -> Quantized:
    return Quantized(4, _nibbles(b[..., 2:18]).reshape(rows, cols), _f16(b, 0), None, 32)


def _q4_1(b: np.ndarray, rows: int, cols: int) -> Quantized:
    return Quantized(4, _nibbles(b[..., 4:20]).reshape(rows, cols), _f16(b, 0), _f16(b, 2), 32)


def _q5_0(b: np.ndarray, rows: int, cols: int) -> Quantized:
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
    codes = (q.astype(np.int16) - 16).astype(np.int8).reshape(rows, cols)
    return Quantized(8, codes, _f16(b, 0), None, 32)


def _q5_1(b: np.ndarray, rows: int, cols: int) -> Quantized:
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
    return Quantized(8, q.astype(np.int8).reshape(rows, cols), _f16(b, 0), _f16(b, 2), 32)


def _k_scales(b: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' scales d * sc and mins -dmin * m, fp32 [rows, 8 * blocks].
    The 12 bytes hold 8 six-bit (sc, m): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4
    in the nibbles of byte j + 4 with their top 2 bits in the high bits of bytes j - 4 and j."""
    s = b[..., 4:16].astype(np.uint8)
    lo, hi = s[..., 0:4], s[..., 4:8]
    sc = np.concatenate([lo & 63, (s[..., 8:12] & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (s[..., 8:12] >> 4) | ((hi >> 6) << 4)], axis=-1)
    d = _f16(b, 0).astype(np.float32)[..., None]
    dmin = _f16(b, 2).astype(np.float32)[..., None]
    return (d * sc).reshape(rows, -1), (-dmin * m).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 256]: 4 chunks of 32 bytes; sub-block 2c is chunk c's low
    nibbles, 2c + 1 its high ones."""
    c = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([c & 0x0F, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(b: np.ndarray, rows: int, cols: int) -> Quantized:
    scales, mins = _k_scales(b, rows)
    return Quantized(4, _k_nibbles(b[..., 16:144]).reshape(rows, cols), scales, mins, 32)


def _q5_k(b: np.ndarray, rows: int, cols: int) -> Quantized:
    scales, mins = _k_scales(b, rows)
    qh = b[..., 16:48]  # [.., 32]: bit s of byte l is the 5th bit of sub-block s's element l
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    q = _k_nibbles(b[..., 48:176]) | (high.reshape(*qh.shape[:-1], 256) << 4)
    return Quantized(8, q.astype(np.int8).reshape(rows, cols), scales, mins, 32)


def _q6_k(b: np.ndarray, rows: int, cols: int) -> Quantized:
    """Two halves of 128: low nibbles of ql[0:32], ql[32:64], their high nibbles give elements
    0-31, 32-63, 64-95, 96-127, with 2-bit pieces of qh[0:32] (bits 0-1, 2-3, 4-5, 6-7)."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [.., half, which 32, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = np.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4,
                    ql[..., 1, :] >> 4], axis=-2)  # [.., half, 4, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., half, 4, 32]
    q = (low | (high << 4)).astype(np.int16) - 32
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [.., 16]
    d = _f16(b, 208).astype(np.float32)[..., None]
    return Quantized(8, q.astype(np.int8).reshape(rows, cols), (d * sc).reshape(rows, -1),
                     None, 16)


_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
           "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
