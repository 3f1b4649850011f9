"""GPTQ and AWQ 4-bit checkpoints: their ``quantization_config``, and their tensors repacked on
the host into int4_matmul's layout (kernels/group_matmul.py). Both formats mean W = (q - z) * s
with integer codes q and zero points z in groups of G along K, as int4_matmul does, so a load
only moves nibbles.

Per quantized linear (K = in_features, N = out_features), as AutoGPTQ's QuantLinear.pack
(GPTQModel for v2) and AutoAWQ's WQLinear_GEMM.from_linear write them (vLLM reads the same):

    GPTQ  qweight [K / 8, N]       int32 along K: word r of column n holds k = 8r .. 8r+7,
                                   low nibble first
          qzeros  [K / G, N / 8]   int32 along N, low nibble first; format "gptq" (v1) stores
                                   zero - 1 (readers add 1), "gptq_v2" the zero itself
          scales  [K / G, N]       fp16;  g_idx [K] int32: column k's group (optional)
    AWQ   qweight [K, N / 8]       int32 along N, interleaved: nibble i of word c holds column
                                   8c + AWQ_ORDER[i]
          qzeros  [K / G, N / 8]   int32, the same interleave; the zero itself
          scales  [K / G, N]       fp16
    ours  qweight [N, K / 8]       int32 along K, low nibble first: GPTQ's qweight transposed
          scales, zeros [N, K / G]

AWQ's zero_point=false and GPTQ's sym=true change how the codes were chosen, not the format:
qzeros are stored either way (vLLM reads them either way too), so they are used as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column (within a word's 8) in nibble i
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True, slots=True)
class QuantFormat:
    method: str  # "gptq" | "awq"
    group_size: int
    zero_offset: int  # added to a stored zero: 1 for GPTQ v1 (stores zero - 1), else 0


def parse_quantization_config(qc: dict[str, Any]) -> QuantFormat:
    """config.json's ``quantization_config`` -> QuantFormat; ValueError naming the field that
    cannot be served. Key spellings: transformers' (bits, group_size, format / checkpoint_format
    / version) and AutoAWQ's (w_bit, q_group_size)."""
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ValueError(f"quant_method {method!r} is not supported (gptq or awq, 4-bit)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} bits={bits!r} is not supported: only 4-bit weights")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0 or group % 16:
        raise ValueError(f"group_size {group!r} is not supported: it must be a positive multiple "
                         "of 16 (int4_matmul's smallest K tile); -1, one group a row, is not")
    if method == "gptq":
        if qc.get("desc_act"):
            raise ValueError("desc_act=true (act-order) is not supported: its columns are "
                             "quantized out of order (g_idx), int4_matmul reads groups in order")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return QuantFormat("gptq", group, 1 if fmt == "gptq" else 0)
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (gemm only)")
    return QuantFormat("awq", group, 0)


def tensor_shapes(fmt: QuantFormat, n: int, k: int) -> dict[str, tuple[int, int]]:
    """Suffix -> stored shape of one linear layer's tensors (g_idx aside: optional)."""
    if k % fmt.group_size or n % 8:
        raise ValueError(f"a [{n}, {k}] layer does not fit {fmt.method}: in_features must be a "
                         f"multiple of group_size={fmt.group_size}, out_features of 8")
    groups = k // fmt.group_size
    qweight = (k // 8, n) if fmt.method == "gptq" else (k, n // 8)
    return {"qweight": qweight, "qzeros": (groups, n // 8), "scales": (groups, n)}


def check_g_idx(g_idx: torch.Tensor, group_size: int) -> None:
    """g_idx: [K]. Anything but column k in group k // G is act-order's reordering."""
    if not torch.equal(g_idx.long(), torch.arange(g_idx.shape[0]) // group_size):
        raise ValueError("g_idx is not arange(in_features) // group_size: an act-order "
                         "(desc_act) checkpoint, whose column order int4_matmul does not support")


def repack(fmt: QuantFormat, t: dict[str, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's stored tensors (``tensor_shapes``) -> (qweight [N, K / 8] int32, scales
    [N, K / G] as stored, zeros [N, K / G] uint8), W = (q - zeros) * scales."""
    # (imported here: importing tinyserve.kernels fixes TRITON_INTERPRET, and config parsing
    # must not do that before the device is chosen)
    from tinyserve.kernels.int4_pack import pack_int4, unpack_int4

    for name in ("qweight", "qzeros"):
        if t[name].dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (8 nibbles a word), got {t[name].dtype}")
    if not t["scales"].dtype.is_floating_point:
        raise ValueError(f"scales must be a float tensor, got {t['scales'].dtype}")
    if fmt.method == "gptq":
        qweight = t["qweight"].T.contiguous()  # the same words: 8 consecutive k, low nibble first
        zeros = unpack_int4(t["qzeros"])  # [K / G, N]
    else:
        qweight = pack_int4(_awq_columns_in_order(unpack_int4(t["qweight"])).T)
        zeros = _awq_columns_in_order(unpack_int4(t["qzeros"]))
    zeros = (zeros + fmt.zero_offset).T.to(torch.uint8).contiguous()  # v1: 1..16
    return qweight, t["scales"].T.contiguous(), zeros


def _awq_columns_in_order(q: torch.Tensor) -> torch.Tensor:
    """q: [R, N] codes in AWQ's nibble order -> [R, N] with column n at n."""
    R, N = q.shape
    return q.view(R, N // 8, 8)[:, :, list(AWQ_NIBBLE_OF_COLUMN)].reshape(R, N)
