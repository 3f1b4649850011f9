"""One choice's output text -> (content, tool calls), whole or as it streams, by the plan's
mode (``plan.py``): "auto" through a format's parser (``parsers.py``), "required" and a named
function from the grammar-forced JSON."""

from __future__ import annotations

import json

from tinyserve.api.tools.parsers import (
    ToolCall,
    ToolCallDelta,
    ToolStreamParser,
    new_call_id,
    parse_tool_calls,
)
from tinyserve.api.tools.plan import ToolPlan


class ToolOutput:
    """One choice's output text -> (content, tool calls), whole or as it streams."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.called = False  # any tool call made (finish_reason "tool_calls")
        self._stream = ToolStreamParser(p.parser, p.names) if p.mode == "auto" else None
        self._text: list[str] = []  # "required": the JSON list, parsed at the end
        self._named_id: str | None = None

    def finish_reason(self, reason: str) -> str:
        """vLLM's rule: a choice that stopped having called tools finished for them (one cut
        short stays "length"); a forced function stops, as OpenAI's does."""
        if reason == "stop" and self.called and self.plan.mode != "named":
            return "tool_calls"
        return reason

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "auto":
            content, calls = parse_tool_calls(text, self.plan.parser, self.plan.names)
        elif mode == "named":
            content, calls = None, [ToolCall(new_call_id(), self.plan.named, text)]
        else:
            content, calls = self._required(text)
        self.called = bool(calls)
        return content, calls

    def pieces(self, text: str, final: bool) -> list[tuple[str, list[ToolCallDelta]]]:
        """A streamed Output's text -> (content, call deltas) in the order they happened: the
        text's, then, on the last Output, what the parser held back."""
        got = [self.feed(text)]
        if final:
            got.append(self.finish())
        return got

    def step(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """``pieces`` merged: the content, then the calls."""
        got = self.pieces(text, final)
        return "".join(t for t, _ in got), [d for _, ds in got for d in ds]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "auto":
            content, deltas = self._stream.feed(text)
            self.called = self._stream.has_calls
            return content, deltas
        if mode == "named":  # the output is the arguments: streamed as they come
            self.called = True
            if self._named_id is None:
                self._named_id = new_call_id()
                return "", [ToolCallDelta(0, self._named_id, self.plan.named, text)]
            return "", [ToolCallDelta(0, arguments=text)] if text else []
        self._text.append(text)
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        mode = self.plan.mode
        if mode == "auto":
            content, deltas = self._stream.finish()
            self.called = self._stream.has_calls
            return content, deltas
        if mode == "named" and self._named_id is None:  # nothing was generated
            self.called = True
            self._named_id = new_call_id()
            return "", [ToolCallDelta(0, self._named_id, self.plan.named, "")]
        if mode != "required":
            return "", []
        content, calls = self._required("".join(self._text))
        self.called = bool(calls)
        return content or "", [ToolCallDelta(i, c.id, c.name, c.arguments)
                               for i, c in enumerate(calls)]

    def _required(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The guided JSON list; text cut short (max_tokens) stays content."""
        try:
            items = json.loads(text)
            calls = [ToolCall(new_call_id(), it["name"],
                              json.dumps(it["parameters"], ensure_ascii=False))
                     for it in items if it.get("name") in self.plan.names]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return text, []
        return (None, calls) if calls else (text, [])
