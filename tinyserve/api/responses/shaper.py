"""The Responses API's answer: a request's Outputs as output items (a ``message`` with one
``output_text`` part, a ``function_call`` per call) and OpenAI's event sequence, each event with
its ``sequence_number``:

    response.created, response.in_progress, then per item output_item.added,
    (content_part.added, output_text.delta..., output_text.done, content_part.done |
    function_call_arguments.delta..., .done), output_item.done, and last response.completed
    or response.incomplete (response.failed for an error after the stream began)

The whole answer is the fold of those events: the Response the last one carries.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tinyserve.api.blocks import Block, Blocks
from tinyserve.api.errors import ApiError
from tinyserve.api.responses.request import ResponsesRequest
from tinyserve.api.shaper import Counts, counts
from tinyserve.api.tools.output import ToolOutput
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.messages import Output

Event = tuple[str, dict[str, Any]]
FINAL_EVENTS = ("response.completed", "response.incomplete")


def new_id(prefix: str) -> str:
    return prefix + "_" + secrets.token_hex(16)


class ResponsesShaper:
    """One response's output items and events. ``keep(response, output_messages)`` stores a
    finished response (and what it adds to the conversation)."""

    def __init__(self, req: ResponsesRequest, model: str, tools: ToolPlan | None,
                 keep: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
        self.req, self.model, self.keep = req, model, keep
        self.id = new_id("resp")
        self.created = int(time.time())
        self.tools = ToolOutput(tools) if tools is not None else None
        self._seq = -1
        self._items = _Items(self._event)

    # -- the Shaper calls
    def plain(self, index: int) -> bool:
        return False  # (every event carries the item and the running sequence number)

    def opening(self) -> list[Event]:
        base = self._response("in_progress", [], None)
        return [self._event("response.created", response=base),
                self._event("response.in_progress", response=base)]

    def chunks(self, out: Output, index: int = 0) -> list[Event]:
        text, deltas = out.text, []
        if self.tools is not None:
            text, deltas = self.tools.step(out.text, out.finish_reason is not None)
        items = self._items
        events: list = items.text(text) if text else []
        for d in deltas:
            events += items.call(d)
        if out.finish_reason is not None:
            events += items.close()
            if not items.blocks:  # no text and no call: an empty message, a whole one
                events += items.text("") + items.close()
            response = self._finished(out)
            kind = "response.incomplete" if response["status"] == "incomplete" \
                else "response.completed"
            events.append(self._event(kind, response=response))
        return events

    def stream_error(self, e: ApiError) -> list[Event]:
        response = self._response("failed", self._outputs(), None)
        response["error"] = {"code": e.code or e.type, "message": e.message}
        return [self._event("response.failed", response=response)]

    def closing(self) -> bytes:
        return b""  # the last event says it all (no [DONE] in this API)

    def fold(self, chunks: Sequence[Event]) -> dict[str, Any]:
        """The Response a client builds from the events: the one the last event carries."""
        return next(payload["response"] for name, payload in reversed(chunks)
                    if name in FINAL_EVENTS)

    # -- the Response object
    def _event(self, kind: str, **fields: Any) -> Event:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq, **fields}

    def _outputs(self) -> list[dict[str, Any]]:
        return [b.item for b in self._items.blocks]

    def _finished(self, last: Output) -> dict[str, Any]:
        status = "incomplete" if last.finish_reason == "length" else "completed"
        items = self._outputs()
        response = self._response(status, items, _usage(counts([last])))
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if last.finish_reason != "abort":
            self.keep(response, [_as_message(items)])
        return response

    def _response(self, status: str, items: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": [_copy(i) for i in items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage,
            "user": req.user, "metadata": req.metadata or {},
        }


class _Items(Blocks):
    """The output items as their events open, fill and close them."""

    def __init__(self, event: Callable[..., Event]) -> None:
        super().__init__()
        self._event = event

    def opened(self, block: Block, index: int) -> list[Event]:
        if block.call is not None:
            block.item = _call_item(new_id("fc"), block.call.id, block.call.name, "",
                                    "in_progress")
            return [self._event("response.output_item.added", output_index=index,
                                item=_copy(block.item))]
        item = block.item = _message_item(new_id("msg"), "", "in_progress")
        item["content"] = []
        events = [self._event("response.output_item.added", output_index=index,
                              item=_copy(item))]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=_copy(part)))
        return events

    def appended(self, block: Block, index: int, piece: str) -> list[Event]:
        item = block.item
        if block.call is not None:
            item["arguments"] += piece
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=piece)]
        item["content"][0]["text"] += piece
        return [self._event("response.output_text.delta", item_id=item["id"],
                            output_index=index, content_index=0, delta=piece, logprobs=[])]

    def closed(self, block: Block, index: int) -> list[Event]:
        item = block.item
        item["status"] = "completed"
        if block.call is not None:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=_copy(part))]
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_copy(item)))
        return events


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
               ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _as_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant's chat turn (for the stored conversation)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _usage(c: Counts) -> dict[str, Any]:
    return {"input_tokens": c.prompt, "input_tokens_details": {"cached_tokens": c.cached},
            "output_tokens": c.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.total}


def _copy(d: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (events must not change after they are sent)."""
    return msgspec.json.decode(msgspec.json.encode(d))
