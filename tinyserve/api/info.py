"""The routes that answer without running the model: the model list and one model's card,
vLLM's tokenize / detokenize, and the OpenAPI document."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
from aiohttp import web

from tinyserve import __version__
from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext, Serving, read_body
from tinyserve.api.errors import ApiError
from tinyserve.api.fields import decode_request
from tinyserve.api.openapi import openapi_spec
from tinyserve.api.prompts import PromptParser
from tinyserve.api.request_types import DetokenizeRequest, TokenizeRequest
from tinyserve.api.response_types import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from tinyserve.config import TenantConfig
from tinyserve.core.adapters import AdapterSpec

OFF_LOOP_IDS = 4096  # a tokenize answer with more ids is named and encoded off the loop


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request goes: a served model, and the LoRA adapter on it (None: the base)."""

    model: str
    adapter: AdapterSpec | None = None


def route(serving: Serving, model: str, tenant: TenantConfig, user: str | None) -> Routed:
    """What answers ``model`` for this caller (404 if none): a served model, a LoRA adapter
    (on its base; another tenant's adapter is a 404 as if it did not exist), or a --route
    alias's target, sticky per user within a tenant (else per tenant), so one user sees one
    version; models that are down are routed around."""
    name = serving.router.resolve(model, f"{tenant.name}\0{user or ''}",
                                  serving.admission.down_models())
    if name is None:
        raise model_not_found(model)
    if name in serving.parsers:
        return Routed(name)
    found = serving.adapter(name) if tenant.may_use(name) else None
    if found is None:
        raise model_not_found(model)
    return Routed(*found)


class InfoRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    async def models(self, request: web.Request) -> web.Response:
        """The served models, then the --route aliases (each as long as its shortest target)."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        return json_response(ModelList(_cards(self._ctx.serving_or_503(), tenant)))

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``)."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        wanted = request.match_info["model_id"]
        for card in _cards(self._ctx.serving_or_503(), tenant):
            if card.id == wanted:
                return json_response(card)
        raise model_not_found(wanted)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        async with self._ctx.parsing:
            req = decode_request(await read_body(request), TokenizeRequest)
            parser = self._parser_for(serving, req.model, tenant, req.user)
            ids = await parser.tokenize(req)

        def answer() -> bytes:
            strs = ([parser.tokenizer.token_text(i) for i in ids] if req.return_token_strs
                    else None)
            return msgspec.json.encode(TokenizeResponse(len(ids), parser.max_model_len, ids,
                                                        strs))
        body = (answer() if len(ids) <= OFF_LOOP_IDS
                else await asyncio.get_running_loop().run_in_executor(None, answer))
        return web.Response(body=body, content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        async with self._ctx.parsing:
            req = decode_request(await read_body(request), DetokenizeRequest)
            parser = self._parser_for(serving, req.model, tenant)
            return json_response(DetokenizeResponse(await parser.detokenize(req.tokens)))

    @staticmethod
    def _parser_for(serving: Serving, model: str | None, tenant: TenantConfig,
                    user: str | None = None) -> PromptParser:
        if model is None:
            return next(iter(serving.parsers.values()))
        # routed with the generate path's key, so an alias picks the same target (down
        # models included: tokenizing needs no engine); an adapter tokenizes as its base
        name = serving.router.resolve(model, f"{tenant.name}\0{user or ''}", set())
        if name is not None and name not in serving.parsers:
            found = serving.adapter(name) if tenant.may_use(name) else None
            name = None if found is None else found[0]
        if name is None:
            raise model_not_found(model)
        return serving.parsers[name]

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_spec(__version__))


def _cards(serving: Serving, tenant: TenantConfig) -> list[ModelCard]:
    """The served models, the adapters this tenant may use (vLLM's: ``parent`` the base
    model, ``root`` the adapter's directory), then the --route aliases."""
    parsers = serving.parsers
    cards = [ModelCard(name, p.max_model_len, p.root) for name, p in parsers.items()]
    for base, registry in serving.adapters.items():
        for name in registry.names():
            if tenant.may_use(name):
                cards.append(ModelCard(name, parsers[base].max_model_len,
                                       registry.get(name).path, parent=base))

    def base_of(target: str) -> str:
        found = serving.adapter(target)
        return target if found is None else found[0]
    for alias, weights in serving.router.routes.items():
        targets = [base_of(n) for n, _ in weights if base_of(n) in parsers]
        if targets:
            cards.append(ModelCard(alias, min(parsers[n].max_model_len for n in targets),
                                   parsers[targets[0]].root))
    return cards
