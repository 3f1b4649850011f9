"""An eager step's inputs as flat host arrays (prefill and mixed steps; decode buckets stage
theirs in ``staging.DecodeStatics``).

    seqs (decodes first):  | d0 | d1 | p0 p0 p0 p0 | p1 p1 |      one row per token
    input_ids, positions, slot_mapping:  [T]      int64
    logits_indices:  [sampled rows..., prompt-logprob rows...]   int64
    decode rows / lengths, prefill rows / lengths:  int32, one per sequence
    prefill_q_start: [num_prefills + 1] int32, offsets of each chunk among the prefill rows
"""

from __future__ import annotations

import msgspec
import numpy as np

from tinyserve.messages import ScheduledSeq


def pack_arrays(seqs: list[ScheduledSeq], rows: list[int], table: np.ndarray, block_size: int,
                holes: dict[int, int], lora: bool = False
                ) -> tuple[list[np.ndarray], list[ScheduledSeq], list[tuple[int, int]], dict]:
    """-> (arrays in ForwardBatch's order: ids, positions, slots, logits indices, decode rows,
    decode lengths, prefill rows, prefill lengths, prefill q starts, and with ``lora`` each
    row's adapter slot when a row has one; the sequences that sample; (row in input_ids,
    source) of each placeholder in ``holes``; the batch's sizes). O(tokens in the step)."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    prompt_rows: list[int] = []
    sampled: list[ScheduledSeq] = []
    fills: list[tuple[int, int]] = []
    dec_rows, dec_lens, pre_rows, pre_lens, q_start = [], [], [], [], [0]
    for i, (s, row) in enumerate(zip(seqs, rows, strict=True)):
        n = len(s.token_ids)
        end = s.start_pos + n
        input_ids.extend(s.token_ids)
        if i in holes:  # its last token: what the step before samples (filled on the device)
            input_ids[-1] = 0
            fills.append((len(input_ids) - 1, holes[i]))
        positions.extend(range(s.start_pos, end))
        blocks = table[row]
        slots.extend(int(blocks[p // bs]) * bs + p % bs for p in range(s.start_pos, end))
        if n == 1:
            dec_rows.append(row)
            dec_lens.append(end)
        else:
            pre_rows.append(row)
            pre_lens.append(end)
            q_start.append(q_start[-1] + n)
        if s.num_drafts:  # a verify: a draw at every position (its rows, see verify_rows)
            logits_rows.extend(range(len(input_ids) - n, len(input_ids)))
            sampled.extend(verify_rows(s))
        elif s.sample:
            logits_rows.append(len(input_ids) - 1)
            sampled.append(s)
        if s.prompt_targets:  # rows after the sampled ones (forward keeps this order)
            first = len(input_ids) - n
            prompt_rows.extend(range(first, first + len(s.prompt_targets)))

    def i64(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    def i32(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int32)

    arrays = [i64(input_ids), i64(positions), i64(slots), i64(logits_rows + prompt_rows),
              i32(dec_rows), i32(dec_lens), i32(pre_rows), i32(pre_lens), i32(q_start)]
    if lora and any(s.lora_slot >= 0 for s in seqs):  # (none: the LoRA kernels do not run)
        arrays.append(np.repeat(np.asarray([s.lora_slot for s in seqs], dtype=np.int32),
                                [len(s.token_ids) for s in seqs]))
    meta = {"max_pos": max(positions, default=-1), "num_decodes": len(dec_lens),
            "decode_max_seq_len": max(dec_lens, default=0),
            "prefill_max_q_len": max((b - a for a, b in zip(q_start, q_start[1:])), default=0)}
    return arrays, sampled, fills, meta


def verify_rows(s: ScheduledSeq) -> list[ScheduledSeq]:
    """A verify's K + 1 draws as rows of their own: row i is drawn as plain decoding's i-th
    next draw (its seed, its min_tokens bans, the output through draft i for penalties and
    the grammar); row 0 is the entry itself. core/speculation.py says why that is exact."""
    rows = [s]
    drafts = s.token_ids[1:]
    for i in range(1, s.num_drafts + 1):
        out = None if s.output_ids is None else s.output_ids + drafts[:i]
        rows.append(msgspec.structs.replace(
            s, seed=s.spec_seeds[i - 1], banned=s.spec_banned[i - 1], output_ids=out,
            spec_row=i))
    return rows
