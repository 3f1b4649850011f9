"""Tool calling for chat completions, the request's side: ``tools`` to the chat template,
``tool_choice`` to a constraint (``output.py`` turns each choice's output into calls).

    tool_choice   what the model is asked for                what its output becomes
    "none"        nothing (tools not shown to it)            content
    "auto"        the template's tool prompt                 a parser's calls (parsers.py)
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
from tinyserve.messages import GrammarSpec

MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template (None: not shown)
    names: frozenset[str]
    mode: str  # "none" | "auto" | "required" | "named"
    parser: str  # parsers.PARSERS
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
