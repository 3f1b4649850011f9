"""The Responses API's request: its body (``ResponsesRequest``), the fields refused by name,
and the chat request it means (``to_chat``; ``routes.py`` has the mapping's table)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tinyserve.api.content import content_text, part_type, shown
from tinyserve.api.decode import decode_request
from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest, ChatMessage

MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value lengths
MAX_KEY, MAX_VALUE = 64, 512


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # accepted with the values that ask for nothing, else refused by name (see _NEUTRAL)
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    truncation: str | None = None
    top_logprobs: int | None = None


_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: not v,
    "conversation": lambda v: v is None,
    "include": lambda v: not v,
    "prompt": lambda v: v is None,
    "reasoning": lambda v: not v or all(x is None for x in v.values()),
    "max_tool_calls": lambda v: v is None,
    "truncation": lambda v: v in (None, "disabled"),
    "top_logprobs": lambda v: not v,
}


def decode(body: bytes) -> ResponsesRequest:
    req = decode_request(body, ResponsesRequest)
    for name, neutral in _NEUTRAL.items():
        if not neutral(getattr(req, name)):
            raise ApiError(400, f"{name} is not supported by this server (only its default, "
                           "which asks for nothing, is accepted)", param=name,
                           code="unsupported_parameter")
    if req.metadata is not None and (len(req.metadata) > MAX_METADATA or any(
            len(k) > MAX_KEY or len(v) > MAX_VALUE for k, v in req.metadata.items())):
        raise ApiError(400, f"metadata: at most {MAX_METADATA} pairs, keys of at most "
                       f"{MAX_KEY} characters and values of at most {MAX_VALUE}",
                       param="metadata")
    return req


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (dicts of ChatMessage's fields)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool message
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or "
                               f"developer, got {shown(role)}", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise ApiError(400, f"{where}: a function_call has string call_id, name and "
                               "arguments", param="input")
            names[call_id] = name
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # [message, calls...]: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiError(400, f"{where}: a function_call_output has a string call_id",
                               param="input")
            msg = {"role": "tool", "tool_call_id": call_id, "content": _text(output, where)}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind == "reasoning":
            continue  # a reasoning model's summary from elsewhere: nothing for this template
        else:
            raise ApiError(400, f"{where}: input items of type {shown(kind)} are not "
                           "supported (message, function_call, function_call_output)",
                           param="input", code="unsupported_parameter")
    return out


def _text(content: Any, where: str) -> str:
    """A message's content (a string, or text parts) as one string."""
    return content_text(content, ("input_text", "output_text", "text", "refusal"),
                        f"{where}.content", part_type, _part_text, param="input")


def _part_text(p: dict[str, Any]) -> Any:
    text = p.get("refusal" if p["type"] == "refusal" else "text")
    return 0 if text is None else text  # (absent or null: not a string, a 400)


def to_chat(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    try:
        chat_messages = msgspec.convert(messages, list[ChatMessage])
    except msgspec.ValidationError as e:
        raise ApiError(400, f"input: {e}", param="input") from None
    return ChatCompletionRequest(
        model=req.model, messages=chat_messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, user=req.user,
        tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_format(req.text))


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ApiError(400, f"tools[{i}]: tools of type {shown(t.get('type'))} are not "
                           "supported (function tools only: built-in tools run on OpenAI's "
                           "side)", param="tools", code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        if fn.get("parameters") is None:
            fn["parameters"] = {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                   '"function", "name": ...}', param="tool_choice",
                   code="unsupported_parameter")


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported by this server",
                       param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(400, 'text.format.type must be "text", "json_object" or "json_schema"',
                   param="text.format")
