"""The runner's persistent block table: one row per sequence, updated with new blocks only.

Plans carry a sequence's blocks from ``first_block`` on (see messages.ScheduledSeq): a
decoding sequence adds one block every block_size tokens, so a steady decode step sends
almost nothing, where rebuilding [batch, max_blocks] tables every step cost 57 ms at 64
sequences x 8,192 blocks. The host keeps a numpy mirror (slot mappings are computed from it);
the device copy is patched by one small kernel launch per step that brings new blocks.

Rows are assigned on first sight (first_block 0) and given back when a plan lists the
sequence in ``freed``. The last row is the padding row (all zeros) that padded bucket rows
point at. A plan that does not match what the table holds (a sequence the runner never saw,
or blocks missing in between) is refused before anything changes: the step fails loudly
instead of reading another sequence's KV.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from tinyserve.messages import ScheduledSeq

log = logging.getLogger(__name__)


class BlockTables:
    def __init__(self, num_rows: int, width: int, block_size: int) -> None:
        self.num_rows = num_rows  # + 1 padding row
        self.width = width
        self.block_size = block_size
        self.pad_row = num_rows
        self.host = np.zeros((num_rows + 1, width), dtype=np.int32)
        self.lengths = np.zeros(num_rows + 1, dtype=np.int64)  # blocks held per row
        self.rows: OrderedDict[int, int] = OrderedDict()  # seq id -> row, least recently used first
        self._free = list(range(num_rows - 1, -1, -1))

    def apply(self, freed: tuple[int, ...], seqs: list[ScheduledSeq]) -> tuple[list[int], list]:
        """Release ``freed`` rows, then take the plan's new blocks. Returns each sequence's row
        and the (row, column, block) triples the device copy needs."""
        self.release(freed)
        bs = self.block_size
        in_plan = {s.seq_id for s in seqs}
        for s in seqs:  # check everything before changing anything
            end = s.first_block + len(s.new_blocks)
            if s.first_block:
                row = self.rows.get(s.seq_id)
                held = 0 if row is None else int(self.lengths[row])
                if held != s.first_block and not (  # (a step run again: applied before)
                        held == end and list(self.host[row, s.first_block:end]) ==
                        list(s.new_blocks)):
                    raise ValueError(f"seq {s.seq_id}: the plan sends blocks from {s.first_block} "
                                     f"on, the runner's table holds {held}")
            if end > self.width:
                raise ValueError(f"seq {s.seq_id}: {end} blocks exceed the table width {self.width}")
            if end * bs < s.start_pos + len(s.token_ids):
                raise ValueError(f"seq {s.seq_id}: {end} blocks cannot hold "
                                 f"{s.start_pos + len(s.token_ids)} tokens")
        rows, updates = [], []
        for s in seqs:
            row = self.rows.get(s.seq_id)
            if row is None:
                row = self._take_row(in_plan)
                self.rows[s.seq_id] = row
            else:
                self.rows.move_to_end(s.seq_id)
            first, new = s.first_block, s.new_blocks
            if new:
                self.host[row, first:first + len(new)] = new
                updates.extend((row, first + i, b) for i, b in enumerate(new))
            self.lengths[row] = first + len(new)
            rows.append(row)
        return rows, updates

    def release(self, freed: tuple[int, ...]) -> None:
        """Drop the rows of released sequences (first thing with every plan, so that a step
        refused afterwards still gives its ``freed`` rows back)."""
        for seq_id in freed:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.lengths[row] = 0
                self._free.append(row)

    def _take_row(self, in_plan: set[int]) -> int:
        if self._free:
            return self._free.pop()
        # Only a plan stream that lost its ``freed`` lists gets here: take the least recently
        # used row of a sequence outside this plan. If that one is still alive, its next plan
        # does not match the table and fails (above) - loudly, never a wrong read.
        for seq_id in self.rows:
            if seq_id not in in_plan:
                row = self.rows.pop(seq_id)
                log.warning("block table full: dropped the row of seq %d", seq_id)
                return row
        raise ValueError(f"more than {self.num_rows} sequences in one step")

    def __len__(self) -> int:
        return len(self.rows)
