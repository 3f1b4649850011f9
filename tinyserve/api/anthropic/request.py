"""Anthropic's Messages requests -> the chat requests they mean: decoding (a 400 naming the
field), the policy for fields Anthropic defines that this server does not honour, and the
translation of system, turns, blocks, tools, tool_choice and sampling fields.

    Messages                                  chat
    system (text or text blocks)              a system message
    user text / text blocks                   a user message (text parts, joined as chat's)
    user tool_result {tool_use_id, content}   a tool message (tool_call_id); is_error: the
                                              content after "Error: "
    assistant text + tool_use {id,name,input} an assistant message with tool_calls
    assistant thinking, redacted_thinking     dropped (Anthropic drops earlier turns' thinking
                                              from the context too)
    tools [{name, description, input_schema}] tools [{type: function, function: ...}]
    tool_choice auto / any / tool / none      "auto" / "required" / {function} / "none";
                                              disable_parallel_tool_use: one call at most
    stop_sequences, temperature, top_p, top_k stop, temperature (default 1, in [0, 1]), ...
    metadata.user_id                          user (sticky --route choice)
    output_config.format (json_schema)        response_format (guided decoding)

Refused with a 400 naming it: image, document and every other block kind; Anthropic's server
tools; a last assistant turn (prefill: the chat path cannot continue a turn); thinking other
than disabled; strict tools unless a grammar forces the call; and the defined fields in
``UNHONOURED`` when they ask for something. Fields nobody defines are ignored, as Anthropic's
SDKs send only what they define.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from tinyserve.api.anthropic.types import (
    CountTokensRequest,
    InputMessage,
    MessagesBlock,
    MessagesRequest,
    MessagesTool,
)
from tinyserve.api.content import content_text, part_type
from tinyserve.api.decode import Neutral, anything, decode_request, empty_list, equals, none
from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest, ChatMessage, ContentPart
from tinyserve.api.tools.plan import MAX_TOOLS
from tinyserve.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")  # Anthropic's rule for tool names
_DROPPED = ("thinking", "redacted_thinking")  # assistant blocks left out of the prompt


# Defined by Anthropic, beyond the structs: accepted only when the value asks for nothing
# this server does not do (True: the value cannot change the answer).
UNHONOURED: dict[str, Neutral] = {
    "container": none, "context_management": none, "mcp_servers": empty_list,
    "speed": equals("standard"), "service_tier": anything, "inference_geo": anything,
    "cache_control": anything,  # the prefix cache is automatic: nothing to mark
    "diagnostics": anything, "user_profile_id": anything, "workspace_id": anything,
}

# -- decoding ---------------------------------------------------------------------------------


def decode(body: bytes, kind: type[CountTokensRequest]) -> Any:
    """JSON body -> the request struct; a 400 naming the field at fault (fields nobody
    defines are ignored, as Anthropic's SDKs send only what they define)."""
    return decode_request(body, kind, UNHONOURED, log_unknown=False)


# -- Messages -> chat -------------------------------------------------------------------------


def chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, bool]:
    """The chat request a Messages (or count_tokens) request means, and whether it allows one
    tool call at most (``disable_parallel_tool_use``)."""
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    if req.messages[-1].role == "assistant":
        raise ApiError(400, "messages: a last assistant turn (prefill) is not supported by "
                       "this server; end with a user turn", param="messages",
                       code="unsupported_parameter")
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise ApiError(400, "thinking: not supported by this server (only {\"type\": "
                       "\"disabled\"})", param="thinking", code="unsupported_parameter")
    messages = [ChatMessage("system", _text(req.system, "system"))] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _turn(m, f"messages[{i}]")
    tools = _tools(req.tools)
    choice, one_call = _tool_choice(req, tools)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=False if one_call else None,
        response_format=_output_format(req))
    if isinstance(req, MessagesRequest):
        _check_sampling(req)
        chat = msgspec.structs.replace(
            chat, max_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p, top_k=req.top_k, user=req.metadata and req.metadata.user_id)
    return chat, one_call


def _turn(m: InputMessage, where: str) -> list[ChatMessage]:
    if m.role not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: must be \"user\" or \"assistant\", got "
                       f"{m.role[:40]!r}", param="messages")
    if isinstance(m.content, str):
        return [ChatMessage(m.role, m.content)]
    if not m.content:
        raise ApiError(400, f"{where}.content: must not be empty", param="messages")
    return (_assistant if m.role == "assistant" else _user)(m.content, where)


def _assistant(blocks: list[MessagesBlock], where: str) -> list[ChatMessage]:
    parts, calls = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b.type == "text":
            parts.append(ContentPart("text", _str(b.text, f"{at}.text")))
        elif b.type == "tool_use":
            if not isinstance(b.input, dict):
                raise ApiError(400, f"{at}.input: must be an object", param="messages")
            calls.append({"id": _str(b.id, f"{at}.id"), "type": "function", "function": {
                "name": _str(b.name, f"{at}.name"),
                "arguments": msgspec.json.encode(b.input).decode()}})
        elif b.type not in _DROPPED:
            raise _unsupported_block(b, at, "text, tool_use")
    return [ChatMessage("assistant", parts if parts else None, tool_calls=calls or None)]


def _user(blocks: list[MessagesBlock], where: str) -> list[ChatMessage]:
    """Text blocks in a row are one user message; each tool_result is a tool message, in the
    order sent."""
    out: list[ChatMessage] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b.type == "text":
            part = ContentPart("text", _str(b.text, f"{at}.text"))
            if out and out[-1].role == "user":
                out[-1].content.append(part)
            else:
                out.append(ChatMessage("user", [part]))
        elif b.type == "tool_result":
            text = "" if b.content is None else _result_text(b.content, f"{at}.content")
            if b.is_error is not None and not isinstance(b.is_error, bool):
                raise ApiError(400, f"{at}.is_error: must be a boolean", param="messages")
            out.append(ChatMessage("tool", "Error: " + text if b.is_error else text,
                                   tool_call_id=_str(b.tool_use_id, f"{at}.tool_use_id")))
        else:
            raise _unsupported_block(b, at, "text, tool_result")
    return out


def _result_text(content: Any, where: str) -> str:
    """A tool_result's content: text, or text blocks (as sent: JSON objects)."""
    return content_text(content, ("text",), where, part_type, lambda b: _block_text(b.get("text")))


def _text(content: str | list[MessagesBlock], where: str) -> str:
    """Text, or text blocks joined; any other block is a 400."""
    return content_text(content, ("text",), where, lambda b: b.type,
                        lambda b: _block_text(b.text))


def _block_text(text: Any) -> Any:
    return 0 if text is None else text  # (a text block without its text: a 400)


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ApiError(400, f"{where}: must be a string", param="messages")
    return v


def _unsupported_block(b: MessagesBlock, where: str, allowed: str) -> ApiError:
    return ApiError(400, f"{where}: content block type {b.type[:40]!r} is not supported here "
                    f"by this server ({allowed} only)", param="messages",
                    code="unsupported_parameter")


def _tools(tools: list[MessagesTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools: at most {MAX_TOOLS}", param="tools")
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise ApiError(400, f"tools[{i}]: server tool {t.type[:40]!r} is not supported by "
                           "this server (client tools only)", param="tools",
                           code="unsupported_parameter")
        if not _TOOL_NAME.fullmatch(t.name):
            raise ApiError(400, f"tools[{i}].name: must match ^[a-zA-Z0-9_-]{{1,128}}$",
                           param="tools")
        schema = t.input_schema
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ApiError(400, f"tools[{i}].input_schema: must be a JSON schema of type "
                           "\"object\"", param="tools")
        if t.defer_loading:
            raise ApiError(400, f"tools[{i}].defer_loading: tool search is not supported by "
                           "this server", param="tools", code="unsupported_parameter")
        fn = {"name": t.name, "parameters": schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(req: CountTokensRequest, tools: list[dict[str, Any]] | None
                 ) -> tuple[Any, bool]:
    """(chat's tool_choice, at most one call). ``strict`` tools need a forced call: only a
    grammar makes a tool's input valid by construction."""
    tc = req.tool_choice
    kind = "auto" if tc is None else tc.type
    strict = any(t.strict for t in req.tools or ())
    if strict and kind not in ("any", "tool"):
        raise ApiError(400, "tools: strict is supported only with tool_choice \"any\" or "
                       "\"tool\" (a grammar forces those calls)", param="tools",
                       code="unsupported_parameter")
    if kind == "tool":
        names = {t["function"]["name"] for t in tools or ()}
        if tc.name not in names:
            raise ApiError(400, f"tool_choice.name: {str(tc.name)[:64]!r} is not one of the "
                           "tools", param="tool_choice")
        choice: Any = {"type": "function", "function": {"name": tc.name}}
    elif kind in ("auto", "none"):
        choice = kind if tools else None
    elif kind == "any":
        choice = "required"
    else:
        raise ApiError(400, f"tool_choice.type: must be auto, any, tool or none, got "
                       f"{kind[:40]!r}", param="tool_choice")
    return choice, tc is not None and tc.disable_parallel_tool_use


def _output_format(req: CountTokensRequest) -> dict[str, Any] | None:
    cfg = req.output_config
    if cfg is None:
        return None
    if cfg.effort not in (None, "high"):
        raise ApiError(400, "output_config.effort: not supported by this server (only "
                       "\"high\", the default)", param="output_config",
                       code="unsupported_parameter")
    fmt = cfg.format
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format: must be {\"type\": \"json_schema\", "
                       "\"schema\": {...}}", param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _check_sampling(req: MessagesRequest) -> None:
    """Anthropic's ranges, named by Anthropic's fields (the engine checks the rest)."""
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise ApiError(400, f"temperature: must be in [0, 1], got {req.temperature}",
                       param="temperature")
    if req.top_k is not None and req.top_k < 0:
        raise ApiError(400, f"top_k: must be >= 0, got {req.top_k}", param="top_k")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop_sequences: at most {MAX_STOP_STRINGS} strings of 1 to "
                       f"{MAX_STOP_CHARS} characters", param="stop_sequences")
