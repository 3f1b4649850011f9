"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes the chat request it means and runs the chat path (the shared handler,
``api/pipeline.py``: routing, the chat template, sampling, tools and grammar-forced calls,
structured output, admission, tenants, streaming, aborts), answered by ``ResponsesShaper``:

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

Built-in tools, background mode, conversations, reasoning and the other fields tinyserve
cannot honour are refused by name (``request.py``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext
from tinyserve.api.errors import ApiError
from tinyserve.api.generate import Generator
from tinyserve.api.pipeline import Call, GenerateRoutes
from tinyserve.api.prepare import Prepared
from tinyserve.api.responses.request import decode, input_messages, to_chat
from tinyserve.api.responses.shaper import ResponsesShaper
from tinyserve.api.responses.store import ResponseStore
from tinyserve.api.shaper import Shaper
from tinyserve.config import TenantConfig

# The chat path's names for fields, as this API names them (in errors)
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}


class ResponsesRoutes(GenerateRoutes):
    def __init__(self, ctx: ApiContext, generator: Generator) -> None:
        super().__init__(ctx, generator)
        self.store = ResponseStore(ctx.cfg.responses_store_max, ctx.cfg.responses_store_max_bytes)

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._translate)

    def _translate(self, body: bytes, tenant: TenantConfig) -> Call:
        req = decode(body)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = self.store.get(tenant.name, req.previous_response_id)
            if found is None:
                raise ApiError(404, f"Previous response with id "
                               f"'{req.previous_response_id[:80]}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = found.messages
        given = input_messages(req.input)

        def keep(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
            if req.store:
                self.store.put(tenant.name, response, history + given + output)

        def shaper(p: Prepared, model: str, choices: int, whole: bool) -> Shaper:
            return ResponsesShaper(req, model, p.tools, keep)
        return Call(request=to_chat(req, history + given), stream=req.stream, shaper=shaper,
                    rename=_renamed)

    async def get(self, request: web.Request) -> web.Response:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        rid = request.match_info["response_id"]
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise ApiError(400, "stream: replaying a stored response as a stream is not "
                           "supported", param="stream", code="unsupported_parameter")
        found = self.store.get(tenant.name, rid)
        if found is None:
            raise _not_found(rid)
        return web.json_response(body=found.response_json)

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
