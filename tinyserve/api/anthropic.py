"""Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``, on the
chat path: a Messages request becomes the ChatCompletionRequest it means
(``anthropic_request.py``), goes through ``completions.prepare`` (routing, template, limits,
grammar) and the one generate path (tenants, quotas, admission, aborts), and
``MessagesShaper`` says the answer in Anthropic's words (``anthropic_types.py``):

    message   content blocks (text, tool_use) built from the output as it streams; ids
              ``msg_...`` and ``toolu_...``; stop_reason end_turn, max_tokens, stop_sequence
              (with the string) or tool_use (a forced tool too, as Anthropic says)
    usage     input_tokens: the prompt tokens computed; cache_read_input_tokens: those the
              prefix cache held (their sum is what count_tokens says)
    stream    message_start, then per block content_block_start / _delta / _stop (a ping
              after the first start), message_delta (stop reason, final usage),
              message_stop; no ``[DONE]``; an error after the headers is an ``error`` event

A whole answer is the fold of the events its stream would have sent, so the two cannot
disagree. Errors, before or during a stream, are in Anthropic's envelope (``errors.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import msgspec
from aiohttp import web

from tinyserve.api.anthropic_request import chat_request, decode
from tinyserve.api.anthropic_types import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessagesUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    TokenCount,
    ToolUseBlock,
)
from tinyserve.api.auth import authenticate
from tinyserve.api.completions import healthy, prepare
from tinyserve.api.context import ApiContext, read_body
from tinyserve.api.errors import ApiError
from tinyserve.api.generate import Generator, Job
from tinyserve.api.info import json_response
from tinyserve.api.tool_parsers import ToolCallDelta
from tinyserve.api.tools import ToolOutput, ToolPlan
from tinyserve.messages import Output

# -- the answer -------------------------------------------------------------------------------

Event = tuple[str, msgspec.Struct]  # (SSE event name = the payload's type, payload)


class _Block:
    """One content block as it is built: text pieces, or a tool call's JSON pieces."""

    def __init__(self, call: ToolCallDelta | None = None) -> None:
        self.call = call
        self.pieces: list[str] = []

    def empty(self) -> TextBlock | ToolUseBlock:
        if self.call is None:
            return TextBlock("")
        return ToolUseBlock(_tool_use_id(self.call.id), self.call.name or "", {})

    def whole(self) -> TextBlock | ToolUseBlock:
        text = "".join(self.pieces)
        if self.call is None:
            return TextBlock(text)
        try:  # cut short (max_tokens): no input, as no object was written
            got = json.loads(text)
        except (ValueError, RecursionError):
            got = {}
        return ToolUseBlock(_tool_use_id(self.call.id), self.call.name or "",
                            got if isinstance(got, dict) else {})


class MessagesShaper:
    """A Messages answer from its Outputs, with the Shaper's calls (``shaping.py``):
    ``chunks`` gives the stream's events, ``body_many`` folds the same events into the
    message. One choice always (``n`` is 1).

    message_start goes out with the first Output (which says how much of the prompt the
    prefix cache held), then per block content_block_start (a ping after the first), deltas,
    content_block_stop; then message_delta (stop reason, final usage) and message_stop."""

    def __init__(self, model: str, tools: ToolPlan | None, one_call: bool) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self._tools = ToolOutput(tools) if tools is not None else None
        self._one_call = one_call
        self._blocks: list[_Block] = []
        self._open = False  # the last block still takes deltas
        self._calls: dict[int, int] = {}  # tool call index -> its block
        self._started = False

    def opening(self) -> list[Event]:
        return []

    def closing(self) -> bytes:
        return b""  # (no [DONE]: message_stop ends it)

    def stream_error(self, e: ApiError) -> list[Event]:
        return [("error", e.anthropic_envelope())]

    def chunks(self, out: Output, index: int = 0) -> list[Event]:
        events: list[Event] = []
        if not self._started:
            self._started = True
            events.append(("message_start", MessageStart(self._message(
                [], None, None, _usage(out, 0)))))
        for text, deltas in self._pieces(out):
            if text:
                events += self._text(text)
            for d in deltas:
                events += self._call(d)
        if out.finish_reason is not None:
            events += self._close()
            reason, sequence = self._stop(out)
            events += [("message_delta", MessageDelta(StopDelta(reason, sequence),
                                                      _usage(out, out.completion_tokens))),
                       ("message_stop", MessageStop())]
        return events

    def body_many(self, per_choice: Sequence[Sequence[Output]]) -> MessageResponse:
        """The message a client accumulates from the stream these Outputs would make."""
        (outs,) = per_choice
        for out in outs:
            self.chunks(out)
        last = outs[-1]
        return self._message([b.whole() for b in self._blocks], *self._stop(last),
                             _usage(last, last.completion_tokens))

    def _message(self, content: list, reason: str | None, sequence: str | None,
                 usage: MessagesUsage) -> MessageResponse:
        return MessageResponse(id=self.id, model=self.model, content=content,
                               stop_reason=reason, stop_sequence=sequence, usage=usage)

    def _pieces(self, out: Output) -> list[tuple[str, list[ToolCallDelta]]]:
        if self._tools is None:
            return [(out.text, [])]
        return self._tools.pieces(out.text, out.finish_reason is not None)

    def _start(self, block: _Block) -> list[Event]:
        events = self._close()
        self._blocks.append(block)
        self._open = True
        index = len(self._blocks) - 1
        events.append(("content_block_start", ContentBlockStart(index, block.empty())))
        if index == 0:  # as Anthropic: a ping after the first block opens
            events.append(("ping", Ping()))
        return events

    def _close(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        return [("content_block_stop", ContentBlockStop(len(self._blocks) - 1))]

    def _delta(self, piece: str, delta: TextDelta | InputJsonDelta) -> list[Event]:
        self._blocks[-1].pieces.append(piece)
        return [("content_block_delta", ContentBlockDelta(len(self._blocks) - 1, delta))]

    def _text(self, text: str) -> list[Event]:
        events = []
        if not (self._open and self._blocks[-1].call is None):
            events = self._start(_Block())
        return events + self._delta(text, TextDelta(text))

    def _call(self, d: ToolCallDelta) -> list[Event]:
        events = []
        if d.id is not None:  # a new call
            if self._one_call and self._calls:
                return []  # disable_parallel_tool_use: the first call only
            events = self._start(_Block(d))
            self._calls[d.index] = len(self._blocks) - 1
        elif self._calls.get(d.index) != len(self._blocks) - 1 or not self._open:
            return []  # (a dropped call's rest: calls come whole, or one at a time)
        if d.arguments:
            events += self._delta(d.arguments, InputJsonDelta(d.arguments))
        return events

    def _stop(self, out: Output) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the final Output."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if isinstance(out.stop_reason, str):  # one of stop_sequences matched
            return "stop_sequence", out.stop_reason
        if self._calls:  # (a forced tool too: Anthropic says tool_use)
            return "tool_use", None
        return "end_turn", None


def _usage(out: Output, output_tokens: int) -> MessagesUsage:
    return MessagesUsage(input_tokens=out.prompt_tokens - out.cached_tokens,
                         output_tokens=output_tokens,
                         cache_read_input_tokens=out.cached_tokens)


def _tool_use_id(call_id: str | None) -> str:
    """Anthropic's id shape for a call the server named (``call_`` + 24 alphanumerics)."""
    return "toolu_" + (call_id or "").removeprefix("call_")


# -- routes -----------------------------------------------------------------------------------


class MessagesRoutes:
    def __init__(self, ctx: ApiContext, generator: Generator) -> None:
        self._ctx = ctx
        self._generator = generator

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``: auth, decode, translate, then the chat path's checks and
        the one generate path (tenants, quotas, admission, aborts) with this API's shaper."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = healthy(self._ctx)
        async with self._ctx.parsing:
            req = decode(await read_body(request), MessagesRequest)
            chat, one_call = chat_request(req)
            routed, _, (prompts, params, tools) = await prepare(serving, tenant, chat)
        return await self._generator.run(request, Job(
            prompts, params, 1, tenant, routed.model, req.stream,
            lambda answering, _choices: MessagesShaper(answering, tools, one_call),
            routed.adapter))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: the prompt's length as the same request would
        run it (system, tools and tool results included), checked as it would be."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = healthy(self._ctx)
        async with self._ctx.parsing:
            chat, _ = chat_request(decode(await read_body(request), CountTokensRequest))
            _, _, (prompts, _, _) = await prepare(serving, tenant, chat, admit=False)
        return json_response(TokenCount(len(prompts[0])))
