"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes the chat request it means, and runs the chat path (``completions.prepare``:
routing, the chat template, sampling, tools and grammar-forced calls, structured output;
``Generator.run``: admission, tenants, streaming, aborts), answered by a ``ResponsesShaper``:

    instructions                  -> a system message first (not carried over, as OpenAI's)
    previous_response_id          -> the stored conversation before this input (its tenant's)
    input: "text"                 -> a user message
    input: [items]                message (user / assistant / system / developer; input_text,
                                  output_text parts), function_call (-> the assistant's tool
                                  call), function_call_output (-> a tool message)
    tools (function), tool_choice -> chat tools; "required" and a named function are forced
                                     by a grammar, as in chat
    text.format                   -> response_format (json_schema, json_object)
    max_output_tokens             -> max_completion_tokens (cut short: status "incomplete")

Output items: a ``message`` with one ``output_text`` part, and a ``function_call`` per call.
Streaming follows OpenAI's event sequence, each event with its ``sequence_number``:
response.created, response.in_progress, then per item output_item.added, (content_part.added,
output_text.delta..., output_text.done, content_part.done | function_call_arguments.delta...,
.done), output_item.done, and last response.completed or response.incomplete
(response.failed for an error after the stream began). Built-in tools, background mode,
conversations, reasoning and the other fields tinyserve cannot honour are refused by name.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.completions import healthy, prepare
from tinyserve.api.context import ApiContext, read_body
from tinyserve.api.errors import ApiError
from tinyserve.api.generate import Generator, Job
from tinyserve.api.response_store import ResponseStore
from tinyserve.api.responses_request import ResponsesRequest, decode, input_messages, to_chat
from tinyserve.api.tool_parsers import ToolCallDelta
from tinyserve.api.tools import ToolOutput, ToolPlan
from tinyserve.messages import Output

# The chat path's names for fields, as this API names them (in errors)
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return prefix + "_" + secrets.token_hex(16)


class ResponsesRoutes:
    def __init__(self, ctx: ApiContext, generator: Generator) -> None:
        self._ctx = ctx
        self._generator = generator
        self.store = ResponseStore(ctx.cfg.responses_store_max, ctx.cfg.responses_store_max_bytes)

    async def create(self, request: web.Request) -> web.StreamResponse:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = healthy(self._ctx)
        async with self._ctx.parsing:
            req = decode(await read_body(request))
            history: list[dict[str, Any]] = []
            if req.previous_response_id is not None:
                found = self.store.get(tenant.name, req.previous_response_id)
                if found is None:
                    raise ApiError(404, f"Previous response with id "
                                   f"'{req.previous_response_id[:80]}' not found.",
                                   param="previous_response_id",
                                   code="previous_response_not_found")
                history = list(found.messages)
            given = input_messages(req.input)
            chat = to_chat(req, history + given)
            try:
                routed, parser, (prompts, params, tools) = await prepare(serving, tenant, chat)
            except ApiError as e:
                raise _renamed(e) from None

        def keep(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
            if req.store:
                self.store.put(tenant.name, response, history + given + output)

        return await self._generator.run(request, Job(
            prompts, params, 1, tenant, routed.model, req.stream,
            lambda answering, _: ResponsesShaper(req, answering, tools, keep), routed.adapter))

    async def get(self, request: web.Request) -> web.Response:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        rid = request.match_info["response_id"]
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise ApiError(400, "stream: replaying a stored response as a stream is not "
                           "supported", param="stream", code="unsupported_parameter")
        found = self.store.get(tenant.name, rid)
        if found is None:
            raise _not_found(rid)
        return web.json_response(body=msgspec.json.encode(found.response))

    async def delete(self, request: web.Request) -> web.Response:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        rid = request.match_info["response_id"]
        if not self.store.delete(tenant.name, rid):
            raise _not_found(rid)
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"No response found with id '{rid[:80]}'.", param="response_id",
                    code="not_found")


def _renamed(e: ApiError) -> ApiError:
    """An error from the chat path, naming this API's field."""
    if e.param in _PARAMS:
        e.message = e.message.replace(e.param, _PARAMS[e.param])
        e.param = _PARAMS[e.param]
    return e


# -- the answer ---------------------------------------------------------------------------------

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
        self._items: list[dict[str, Any]] = []  # output items, done or being streamed
        self._open: dict[str, Any] | None = None  # the item being streamed

    # -- the Shaper calls
    def opening(self) -> list:
        base = self._response("in_progress", [], None)
        return [self._event("response.created", response=base),
                self._event("response.in_progress", response=base)]

    def chunks(self, out: Output, index: int = 0) -> list:
        text, deltas = out.text, []
        if self.tools is not None:
            text, deltas = self.tools.step(out.text, out.finish_reason is not None)
        events: list = []
        if text:
            events += self._text_delta(text)
        for d in deltas:
            events += self._call_delta(d)
        if out.finish_reason is not None:
            events += self._close()
            if not self._items:  # no text and no call: an empty message, as a whole body has
                events += self._text_delta("") + self._close()
            response = self._finished(self._items, out)
            kind = "response.incomplete" if response["status"] == "incomplete" \
                else "response.completed"
            events.append(self._event(kind, response=response))
        return events

    def stream_error(self, e: ApiError) -> list:
        response = self._response("failed", self._items, None)
        response["error"] = {"code": e.code or e.type, "message": e.message}
        return [self._event("response.failed", response=response)]

    def closing(self) -> bytes:
        return b""  # the last event says it all (no [DONE] in this API)

    def body_many(self, per_choice: Sequence[Sequence[Output]]) -> dict[str, Any]:
        outs = per_choice[0]
        text = "".join(o.text for o in outs)
        content, calls = (text, []) if self.tools is None else self.tools.whole(text)
        items = []
        if content or not calls:
            items.append(_message_item(new_id("msg"), content or "", "completed"))
        items += [_call_item(new_id("fc"), c.id, c.name, c.arguments, "completed")
                  for c in calls]
        return self._finished(items, outs[-1])

    # -- streaming items
    def _text_delta(self, text: str) -> list:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            item = self._opened(_message_item(new_id("msg"), "", "in_progress"))
            item["content"] = []
            events.append(self._event("response.output_item.added", output_index=self._index,
                                      item=_copy(item)))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._index, content_index=0,
                                      part=_copy(part)))
        part = self._open["content"][0]
        part["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=self._index, content_index=0, delta=text,
                                      logprobs=[]))
        return events

    def _call_delta(self, d: ToolCallDelta) -> list:
        events = []
        if d.id is not None:  # a new call
            events += self._close()
            item = self._opened(_call_item(new_id("fc"), d.id, d.name, "", "in_progress"))
            events.append(self._event("response.output_item.added", output_index=self._index,
                                      item=_copy(item)))
        if d.arguments and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += d.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open["id"], output_index=self._index,
                                      delta=d.arguments))
        return events

    def _opened(self, item: dict[str, Any]) -> dict[str, Any]:
        self._items.append(item)
        self._open = item
        return item

    @property
    def _index(self) -> int:
        return len(self._items) - 1

    def _close(self) -> list:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        i = self._items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=i, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=i, content_index=0, part=_copy(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=i, name=item["name"],
                                  arguments=item["arguments"])]
        events.append(self._event("response.output_item.done", output_index=i,
                                  item=_copy(item)))
        return events

    # -- the Response object
    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq, **fields}

    def _finished(self, items: list[dict[str, Any]], last: Output) -> dict[str, Any]:
        status = "incomplete" if last.finish_reason == "length" else "completed"
        response = self._response(status, items, _usage(last))
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


def _usage(out: Output) -> dict[str, Any]:
    return {"input_tokens": out.prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.cached_tokens},
            "output_tokens": out.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def _copy(d: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (events must not change after they are sent)."""
    return msgspec.json.decode(msgspec.json.encode(d))
