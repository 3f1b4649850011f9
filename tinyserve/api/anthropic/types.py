"""Anthropic's Messages API on the wire (msgspec Structs): the request bodies of
``POST /v1/messages`` and ``/v1/messages/count_tokens``, the message it answers with, and the
events of its stream.

Requests decode loosely where Anthropic's block kinds differ (a block's kind-specific fields are
``Any`` here): ``request.py`` checks each block by its ``type`` and answers a 400 that names
the block, instead of msgspec's complaint about a field of some other kind. Fields beyond the
structs are ``request.py``'s to allow or refuse (``UNHONOURED``).

Every answer struct is tagged with its ``type`` (Anthropic's discriminator): an event's JSON is
``{"type": <event name>, ...}``, the same name its SSE ``event:`` line carries.
"""

from __future__ import annotations

from typing import Any

import msgspec

# -- requests ---------------------------------------------------------------------------------


class MessagesBlock(msgspec.Struct, kw_only=True):
    """One content block as sent, of any kind; the fields used are checked per kind:

        text         text
        tool_use     id, name, input (an object)            (assistant turns)
        tool_result  tool_use_id, content (text or text blocks), is_error   (user turns)
        thinking, redacted_thinking                          (assistant turns: dropped)
    """

    type: str
    text: Any = None
    id: Any = None
    name: Any = None
    input: Any = None
    tool_use_id: Any = None
    content: Any = None
    is_error: Any = None


class InputMessage(msgspec.Struct):
    role: str
    content: str | list[MessagesBlock]


class MessagesTool(msgspec.Struct, kw_only=True):
    """A client tool (``type`` absent or ``"custom"``); Anthropic's server tools (web search,
    code execution, ...) carry another ``type`` and no ``input_schema``: refused by name."""

    name: str
    input_schema: Any = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None  # inputs always valid: only where a grammar forces the call
    defer_loading: bool | None = None  # tool search (not offered): only false


class MessagesToolChoice(msgspec.Struct, kw_only=True):
    type: str  # "auto" | "any" | "tool" | "none"
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool = False


class MessagesMetadata(msgspec.Struct):
    user_id: str | None = None


class MessagesOutputConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None  # only the default ("high")
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[InputMessage]
    system: str | list[MessagesBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}
    output_config: MessagesOutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``: the prompt, and how to generate."""

    max_tokens: int  # required, as Anthropic's
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None  # Anthropic's default 1.0, range [0, 1]
    top_p: float | None = None
    top_k: int | None = None
    metadata: MessagesMetadata | None = None


# -- answers ----------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str  # "toolu_" + 24 alphanumerics
    name: str
    input: dict[str, Any]


class MessagesUsage(msgspec.Struct):
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, the ones read from
    the prefix cache are ``cache_read_input_tokens`` (the prompt is their sum). Nothing is
    ever written to a cache at a price, so ``cache_creation_input_tokens`` is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str  # "msg_" + 32 hex digits
    role: str = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None  # "end_turn" | "max_tokens" | "stop_sequence" | "tool_use"
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(msgspec.Struct):
    input_tokens: int


# -- stream events ----------------------------------------------------------------------------


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessageResponse  # no content yet, stop_reason and stop_sequence null


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: TextBlock | ToolUseBlock  # empty: text "", input {}


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str  # the pieces of a block, joined, are its input's JSON


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: MessagesUsage  # cumulative totals: a client overwrites message_start's with them


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass
