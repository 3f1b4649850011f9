"""Anthropic's answer: a request's Outputs as a Messages stream, and the message a client
folds from it (the whole answer is that fold, so the two cannot disagree).

    message   content blocks (text, tool_use) built from the output as it streams; ids
              ``msg_...`` and ``toolu_...``; stop_reason end_turn, max_tokens, stop_sequence
              (with the string) or tool_use (a forced tool too, as Anthropic says)
    usage     input_tokens: the prompt tokens computed; cache_read_input_tokens: those the
              prefix cache held (their sum is what count_tokens says)
    stream    message_start, then per block content_block_start / _delta / _stop (a ping
              after the first start), message_delta (stop reason, final usage),
              message_stop; no ``[DONE]``; an error after the headers is an ``error`` event
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import msgspec

from tinyserve.api.anthropic.types import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessageStart,
    MessageStop,
    MessagesUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ToolUseBlock,
)
from tinyserve.api.blocks import Block, Blocks
from tinyserve.api.errors import ApiError
from tinyserve.api.shaper import Counts, counts
from tinyserve.api.tools.output import ToolOutput
from tinyserve.api.tools.parsers import ToolCallDelta
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.messages import Output

Event = tuple[str, msgspec.Struct]  # (SSE event name = the payload's type, payload)


class MessagesShaper:
    """One choice always (``n`` is 1). message_start goes out with the first Output (which
    says how much of the prompt the prefix cache held), then the blocks' events, then
    message_delta (stop reason, final usage) and message_stop."""

    def __init__(self, model: str, tools: ToolPlan | None, one_call: bool) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self._tools = ToolOutput(tools) if tools is not None else None
        self._blocks = _Blocks(one_call)
        self._started = False

    def plain(self, index: int) -> bool:
        return False  # (a text delta names its block's index)

    def opening(self) -> list[Event]:
        return []

    def closing(self) -> bytes:
        return b""  # (no [DONE]: message_stop ends it)

    def stream_error(self, e: ApiError) -> list[Event]:
        return [("error", e.anthropic_envelope())]

    def chunks(self, out: Output, index: int = 0) -> list[Event]:
        events: list[Event] = []
        blocks, use = self._blocks, counts([out])
        if not self._started:
            self._started = True
            events.append(("message_start", MessageStart(MessageResponse(
                id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
                usage=_usage(use, 0)))))
        for text, deltas in self._pieces(out):
            if text:
                events += blocks.text(text)
            for d in deltas:
                events += blocks.call(d)
        if out.finish_reason is not None:
            events += blocks.close()
            reason, sequence = self._stop(out)
            events += [("message_delta", MessageDelta(StopDelta(reason, sequence),
                                                      _usage(use, use.completion))),
                       ("message_stop", MessageStop())]
        return events

    def fold(self, chunks: Sequence[Event]) -> MessageResponse:
        """The message a client accumulates from the events."""
        message = stop = None
        blocks: list[TextBlock | ToolUseBlock] = []
        pieces: list[list[str]] = []
        for name, event in chunks:
            if name == "message_start":
                message = event.message
            elif name == "content_block_start":
                blocks.append(event.content_block)
                pieces.append([])
            elif name == "content_block_delta":
                d = event.delta
                pieces[event.index].append(d.text if isinstance(d, TextDelta) else d.partial_json)
            elif name == "message_delta":
                stop = event
        content = [TextBlock("".join(p)) if isinstance(b, TextBlock)
                   else ToolUseBlock(b.id, b.name, _input("".join(p)))
                   for b, p in zip(blocks, pieces, strict=True)]
        return msgspec.structs.replace(message, content=content, stop_reason=stop.delta.stop_reason,
                                       stop_sequence=stop.delta.stop_sequence, usage=stop.usage)

    def _pieces(self, out: Output) -> list[tuple[str, list[ToolCallDelta]]]:
        if self._tools is None:
            return [(out.text, [])]
        return self._tools.pieces(out.text, out.finish_reason is not None)

    def _stop(self, out: Output) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the final Output."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if isinstance(out.stop_reason, str):  # one of stop_sequences matched
            return "stop_sequence", out.stop_reason
        if self._blocks.calls:  # (a forced tool too: Anthropic says tool_use)
            return "tool_use", None
        return "end_turn", None


class _Blocks(Blocks):
    """Content blocks as Anthropic's events open, fill and close them."""

    def __init__(self, one_call: bool) -> None:
        super().__init__()
        self._one_call = one_call  # disable_parallel_tool_use: the first call only
        self.calls = 0

    def takes_call(self, d: ToolCallDelta) -> bool:
        if self._one_call and self.calls:
            return False
        self.calls += 1
        return True

    def opened(self, block: Block, index: int) -> list[Event]:
        empty = TextBlock("") if block.call is None else ToolUseBlock(
            _tool_use_id(block.call.id), block.call.name or "", {})
        events: list[Event] = [("content_block_start", ContentBlockStart(index, empty))]
        if index == 0:  # as Anthropic: a ping after the first block opens
            events.append(("ping", Ping()))
        return events

    def appended(self, block: Block, index: int, piece: str) -> list[Event]:
        delta = TextDelta(piece) if block.call is None else InputJsonDelta(piece)
        return [("content_block_delta", ContentBlockDelta(index, delta))]

    def closed(self, block: Block, index: int) -> list[Event]:
        return [("content_block_stop", ContentBlockStop(index))]


def _usage(c: Counts, output_tokens: int) -> MessagesUsage:
    return MessagesUsage(input_tokens=c.prompt - c.cached, output_tokens=output_tokens,
                         cache_read_input_tokens=c.cached)


def _input(text: str) -> dict:
    """A tool_use block's input from its JSON pieces; cut short (max_tokens): no input, as no
    object was written."""
    try:
        got = json.loads(text)
    except (ValueError, RecursionError):
        got = {}
    return got if isinstance(got, dict) else {}


def _tool_use_id(call_id: str | None) -> str:
    """Anthropic's id shape for a call the server named (``call_`` + 24 alphanumerics)."""
    return "toolu_" + (call_id or "").removeprefix("call_")
