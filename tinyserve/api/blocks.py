"""An answer's content blocks as its stream builds them, for the APIs that stream blocks (the
Responses API's output items, Anthropic's content blocks): each block is text, or one tool
call's arguments; one is open at a time.

    text piece     into the open text block, or (after a call, or at first) a new one
    call, first    a new block (the API may refuse it: Anthropic's one call at most)
    call, more     its arguments, into its block while it is open (else dropped)
    close          the open block is done

What each step sends is the API's: a subclass says it in ``opened``, ``appended``, ``closed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinyserve.api.tools.parsers import ToolCallDelta


@dataclass(slots=True, eq=False)
class Block:
    call: ToolCallDelta | None  # its first delta (id, name); None: a text block
    pieces: list[str] = field(default_factory=list)
    item: Any = None  # the API's own record of it (the Responses API's output item)


class Blocks:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None

    def text(self, piece: str) -> list:
        """A piece of text ("" opens a text block and appends nothing)."""
        events = []
        if self.open is None or self.open.call is not None:
            events = self.close() + self._start(Block(None))
        if piece:
            events += self._append(piece)
        return events

    def call(self, d: ToolCallDelta) -> list:
        """A tool call's delta: its first opens its block, the rest append arguments."""
        events = []
        if d.id is not None:
            if not self.takes_call(d):
                return []
            events = self.close() + self._start(Block(d))
        elif self.open is None or self.open.call is None or self.open.call.index != d.index:
            return []  # (a dropped call's rest: calls come whole, or one at a time)
        if d.arguments:
            events += self._append(d.arguments)
        return events

    def close(self) -> list:
        block, self.open = self.open, None
        return [] if block is None else self.closed(block, self.blocks.index(block))

    def _start(self, block: Block) -> list:
        self.blocks.append(block)
        self.open = block
        return self.opened(block, len(self.blocks) - 1)

    def _append(self, piece: str) -> list:
        self.open.pieces.append(piece)
        return self.appended(self.open, len(self.blocks) - 1, piece)

    # -- the API's words ---------------------------------------------------------------------
    def takes_call(self, d: ToolCallDelta) -> bool:
        return True

    def opened(self, block: Block, index: int) -> list:
        return []

    def appended(self, block: Block, index: int, piece: str) -> list:
        return []

    def closed(self, block: Block, index: int) -> list:
        return []
