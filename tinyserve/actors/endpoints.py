"""The API's other endpoints, mixed into Ingress: the model list and one model's card,
vLLM's tokenize / detokenize, the live route table (admin) and the OpenAPI document; and
``Backend``, what every handler talks to once the models are loaded.

They share Ingress's guards (``_auth``, ``_admin``, ``_backend``, ``_body``, the ``_parsing``
bound); nothing here submits work to the engine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from tinyserve import __version__
from tinyserve.actors.admission import Admission
from tinyserve.actors.metrics import Metrics
from tinyserve.actors.supervisor import Supervisor
from tinyserve.config import TenantConfig
from tinyserve.openapi import openapi_spec
from tinyserve.prompts import PromptParser
from tinyserve.protocol import (
    ApiError,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RouteUpdate,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)
from tinyserve.routing import Router, describe

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("tinyserve.actors.ingress")


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")


@dataclass(slots=True)
class Backend:
    """What ingress talks to once the model is loaded (until then handlers answer 503)."""

    parsers: dict[str, PromptParser]  # by served model name
    admission: Admission  # and its lanes: one per model, with that model's batcher inbox
    router: Router  # ingress is its only writer (POST /admin/routes)
    metrics: Metrics
    supervisor: Supervisor


class InfoEndpoints:
    """Handlers for Ingress (which provides _auth, _admin, _backend, _body, _parsing)."""

    _auth: Callable[[web.Request], TenantConfig]
    _admin: Callable[[web.Request], TenantConfig]
    _backend: Callable[[], Backend]
    _parsing: asyncio.Semaphore

    async def models(self, request: web.Request) -> web.Response:
        """The served models, then the --route aliases (each as long as its shortest target)."""
        self._auth(request)
        b = self._backend()
        return json_response(ModelList(self._cards(b)))

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``)."""
        self._auth(request)
        wanted = request.match_info["model_id"]
        for card in self._cards(self._backend()):
            if card.id == wanted:
                return json_response(card)
        raise ApiError(404, f"The model `{wanted}` does not exist.", param="model",
                       code="model_not_found")

    @staticmethod
    def _cards(b: Backend) -> list[ModelCard]:
        cards = [ModelCard(name, p.max_model_len, p.root) for name, p in b.parsers.items()]
        for alias, weights in b.router.routes.items():
            cards.append(ModelCard(alias, min(b.parsers[n].max_model_len for n, _ in weights),
                                   b.parsers[weights[0][0]].root))
        return cards

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``."""
        tenant = self._auth(request)
        b = self._backend()
        async with self._parsing:
            req = decode_request(await self._body(request), TokenizeRequest)
            parser = self._parser_for(b, req.model, tenant, req.user)
            ids = await parser.tokenize(req)

        def answer() -> bytes:
            strs = ([parser.tokenizer.token_text(i) for i in ids] if req.return_token_strs
                    else None)
            return msgspec.json.encode(TokenizeResponse(len(ids), parser.max_model_len, ids,
                                                        strs))
        # A long text is many ids: named and encoded off the loop.
        body = (answer() if len(ids) <= 4096
                else await asyncio.get_running_loop().run_in_executor(None, answer))
        return web.Response(body=body, content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``."""
        tenant = self._auth(request)
        b = self._backend()
        async with self._parsing:
            req = decode_request(await self._body(request), DetokenizeRequest)
            parser = self._parser_for(b, req.model, tenant)
            return json_response(DetokenizeResponse(await parser.detokenize(req.tokens)))

    @staticmethod
    def _parser_for(b: Backend, model: str | None, tenant: TenantConfig,
                    user: str | None = None) -> PromptParser:
        if model is None:
            return next(iter(b.parsers.values()))
        # The key _generate routes with, so an alias picks the same target.
        name = b.router.resolve(model, f"{tenant.name}\0{user or ''}", set())
        if name is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return b.parsers[name]

    # -- routes (admin) ----------------------------------------------------------------------------
    async def get_routes(self, request: web.Request) -> web.Response:
        self._admin(request)
        b = self._backend()
        return json_response({"routes": b.router.table(), "fallbacks": b.router.fallbacks})

    async def set_routes(self, request: web.Request) -> web.Response:
        """Change one alias's weights, live: requests already routed keep their model."""
        tenant = self._admin(request)
        b = self._backend()
        upd = decode_request(await self._body(request), RouteUpdate)
        if upd.alias not in b.router.routes:
            raise ApiError(404, f"no route named {upd.alias!r} (routes: "
                           f"{', '.join(b.router.routes) or 'none'})", param="alias")
        try:
            old = b.router.set_route(upd.alias, tuple(upd.weights.items()))
        except ValueError as e:
            raise ApiError(400, str(e), param="weights") from None
        log.warning("route %s: %s -> %s (by tenant %s)", upd.alias, describe(old),
                    describe(b.router.routes[upd.alias]), tenant.name)
        return json_response({"routes": b.router.table(), "fallbacks": b.router.fallbacks})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_spec(__version__))
