"""``GET /openapi.json``: the API's OpenAPI 3.1 description, generated from the msgspec types.

Generated, not written by hand, so it cannot drift from what the server decodes; standard API
fuzzers (schemathesis and the like) can drive the server from it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tinyserve.api.anthropic.types import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from tinyserve.api.errors import AnthropicError, ErrorResponse
from tinyserve.api.openai.bodies import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from tinyserve.api.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tinyserve.api.ops.loras import LoadLoraRequest, UnloadLoraRequest
from tinyserve.api.ops.routes import RouteUpdate
from tinyserve.api.responses.request import ResponsesRequest

_TYPES = (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk, CompletionRequest,
          CompletionResponse, ModelList, ModelCard, ErrorResponse, RouteUpdate, TokenizeRequest,
          TokenizeResponse, DetokenizeRequest, DetokenizeResponse,
          MessagesRequest, MessageResponse, CountTokensRequest, TokenCount, AnthropicError,
          ResponsesRequest, LoadLoraRequest, UnloadLoraRequest)
_RESPONSE = {"type": "object", "description": "OpenAI's Response object (id, object: "
             "response, status, output items, usage, ...)"}
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True,
                 "schema": {"type": "string"}}]


def _ref(t: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{t.__name__}"}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": {
        "application/json": {"schema": _ref(ErrorResponse)}}} for c in codes}


def _generate(request: type, response: type, chunk: type, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the completion (JSON), or Server-Sent Events of "
                                   f"{chunk.__name__} when stream is true",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 415, 429, 500, 503)}}}


def _post(request: type, response: type, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {
            "application/json": {"schema": _ref(response)}}}, **_errors(400, 401, 404, 413, 415)}}}


def _anthropic(request: type, response: type, summary: str, streams: bool) -> dict[str, Any]:
    """An Anthropic route: its errors in Anthropic's envelope (529 where others say 503)."""
    ok: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    errors = {str(c): {"description": "error", "content": {
        "application/json": {"schema": _ref(AnthropicError)}}}
        for c in (400, 401, 404, 413, 415, 429, 500, 529)}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the message (JSON), or Server-Sent Events "
                              "(message_start ... message_stop) when stream is true"
                              if streams else "ok", "content": ok}, **errors}}}


def openapi_spec(version: str) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        _TYPES, ref_template="#/components/schemas/{name}")
    probe = {"get": {"responses": {"200": {"description": "ok"}, **_errors(503)}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tinyserve", "version": version,
                 "description": "OpenAI-compatible completions and chat completions"},
        "paths": {
            "/v1/completions": _generate(CompletionRequest, CompletionResponse,
                                         CompletionResponse, "Create a completion"),
            "/v1/chat/completions": _generate(ChatCompletionRequest, ChatCompletionResponse,
                                              ChatCompletionChunk, "Create a chat completion"),
            "/v1/responses": {"post": {
                "summary": "Create a response (OpenAI's Responses API)",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref(ResponsesRequest)}}},
                "responses": {"200": {"description": "the Response (JSON), or Server-Sent "
                                      "Events (response.created ... response.completed) when "
                                      "stream is true", "content": {
                                          "application/json": {"schema": _RESPONSE},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                              **_errors(400, 401, 404, 413, 415, 429, 500, 503)}}},
            "/v1/responses/{response_id}": {
                "get": {"summary": "A stored response (the tenant's own)",
                        "parameters": _RESPONSE_ID, "responses": {
                            "200": {"description": "the Response", "content": {
                                "application/json": {"schema": _RESPONSE}}},
                            **_errors(400, 401, 404)}},
                "delete": {"summary": "Delete a stored response", "parameters": _RESPONSE_ID,
                           "responses": {"200": {"description": "deleted"},
                                         **_errors(401, 404)}}},
            "/v1/messages": _anthropic(MessagesRequest, MessageResponse,
                                       "Create a message (Anthropic's Messages API)", True),
            "/v1/messages/count_tokens": _anthropic(CountTokensRequest, TokenCount,
                                                    "Count a message's input tokens", False),
            "/v1/models": {"get": {"responses": {"200": {"description": "the served models",
                "content": {"application/json": {"schema": _ref(ModelList)}}}, **_errors(401)}}},
            "/v1/models/{model_id}": {"get": {
                "parameters": [{"name": "model_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "one served model or route", "content": {
                    "application/json": {"schema": _ref(ModelCard)}}}, **_errors(401, 404)}}},
            "/tokenize": _post(TokenizeRequest, TokenizeResponse,
                               "Token ids of a prompt or chat (vLLM)"),
            "/detokenize": _post(DetokenizeRequest, DetokenizeResponse,
                                 "Text of token ids (vLLM)"),
            "/admin/routes": {
                "get": {"summary": "The route table (admin tenants)", "responses": {
                    "200": {"description": "routes and fallbacks"}, **_errors(401, 403)}},
                "post": {"summary": "Change one route's weights, live (admin tenants)",
                         "requestBody": {"required": True, "content": {
                             "application/json": {"schema": _ref(RouteUpdate)}}},
                         "responses": {"200": {"description": "the new route table"},
                                       **_errors(400, 401, 403, 404, 413, 415)}}},
            "/v1/load_lora_adapter": {"post": {
                "summary": "Serve a PEFT LoRA directory as a model name (admin tenants; vLLM's)",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref(LoadLoraRequest)}}},
                "responses": {"200": {"description": "loaded"},
                              **_errors(400, 401, 403, 404, 413, 415)}}},
            "/v1/unload_lora_adapter": {"post": {
                "summary": "Stop serving an adapter once no request uses it (admin tenants)",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref(UnloadLoraRequest)}}},
                "responses": {"200": {"description": "unloaded"},
                              **_errors(400, 401, 403, 404, 409, 413, 415)}}},
            "/health": probe,
            "/ready": probe,
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
