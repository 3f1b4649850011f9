"""ForwardBatch: one step's metadata, as the model's layers read it.

One step runs a flat, ragged batch of T tokens. Decode tokens (one query per sequence) come
first and use the split-KV decode kernel; the rest are prefill chunks:

    tokens  [ d0 d1 ... dD-1 | p0 p0 p0 p0 | p1 p1 | ... ]
              one per decode   chunk of seq  chunk ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    """Per-step metadata, all device tensors except the host ints that size grids."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset
    num_decodes: int  # the first num_decodes tokens are decode queries
    block_tables: torch.Tensor  # [R, max_blocks] int32: the runner's persistent table
    decode_rows: torch.Tensor  # [num_decodes]: each decode's row in block_tables
    decode_seq_lens: torch.Tensor  # [num_decodes], including the new token
    decode_max_seq_len: int  # sizes the split grid (a bucket uses max_model_len: fixed)
    prefill_rows: torch.Tensor  # [P]: each prefill chunk's row in block_tables
    prefill_seq_lens: torch.Tensor  # [P] int32, cached + new tokens
    prefill_q_start: torch.Tensor  # [P + 1] int32, offsets into the prefill part
    prefill_max_q_len: int
    logits_indices: torch.Tensor | None  # [S] int64: rows whose next token is sampled (None: all)
    lora_slots: torch.Tensor | None = None  # [T] int32: each row's adapter slot (-1: base)
