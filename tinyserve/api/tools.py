"""Tool calling for chat completions: ``tools`` to the chat template, ``tool_choice`` to a
constraint, each choice's output to OpenAI ``tool_calls`` (whole or streamed).

    tool_choice   what the model is asked for                what its output becomes
    "none"        nothing (tools not shown to it)            content
    "auto"        the template's tool prompt                 a parser's calls (tool_parsers.py)
                                                             and the rest as content
    "required"    a JSON list of {"name", "parameters"}      one call per element
                  (guided decoding: grammar.py)
    {function}    that function's parameters, as JSON        one call of that function
                  (guided decoding)

vLLM does the same; like OpenAI, a forced function ends with finish_reason "stop", calls made
by choice end with "tool_calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tinyserve.api.errors import ApiError
from tinyserve.api.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolStreamParser,
    new_call_id,
    parse_tool_calls,
)
from tinyserve.messages import GrammarSpec

MAX_TOOLS = 128  # OpenAI's limit
# The roles the chat API defines: a template renders a role verbatim, so any other text could
# write a turn of its own ("user|>\nfake\n<|system"); OpenAI answers 400 to an unknown role.
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template (None: not shown)
    names: frozenset[str]
    mode: str  # "none" | "auto" | "required" | "named"
    parser: str  # tool_parsers.PARSERS
    named: str | None = None  # mode "named": the function
    guided: GrammarSpec | None = None  # modes "required" and "named"


def plan(tools: list[Any] | None, tool_choice: Any, parser: str,
         parallel: bool | None = None) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the field); None: no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} functions",
                       param="tools")
    schemas: dict[str, dict] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        params = fn.get("parameters", {"type": "object"}) if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or not isinstance(params, dict):
            raise ApiError(400, 'tools: each must be {"type": "function", "function": {"name": '
                           '..., "parameters": {...}}}', param="tools")
        if name in schemas:
            raise ApiError(400, f"tools: {name[:64]!r} is defined twice", param="tools")
        schemas[name] = params
    names = frozenset(schemas)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, names, "none", parser)
    if choice == "auto":
        return ToolPlan(tools, names, "auto", parser)
    if choice == "required":
        call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for n, p in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if parallel is False:  # OpenAI's parallel_tool_calls: false, at most one call
            schema["maxItems"] = 1
        return ToolPlan(tools, names, "required", parser,
                        guided=GrammarSpec("json_schema", json.dumps(schema)))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in schemas:
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                       '"function", "function": {"name": <one of tools>}}', param="tool_choice")
    return ToolPlan(tools, names, "named", parser, named=name,
                    guided=GrammarSpec("json_schema", json.dumps(schemas[name])))


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


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as templates expect them (transformers' and vLLM's way): text content,
    assistant tool calls with their arguments parsed, a tool result's id and name."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{m.role[:40]!r}", param="messages")
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, 'messages: each tool call is {"id": ..., "type": '
                                   '"function", "function": {"name": ..., "arguments": ...}}',
                                   param="messages")
                fn = dict(fn)
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except (ValueError, RecursionError):
                        pass
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        out.append(d)
    return out
