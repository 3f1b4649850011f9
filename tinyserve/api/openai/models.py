"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served models, the adapters the tenant
may use, then the --route aliases, as OpenAI's model cards with vLLM's extra fields."""

from __future__ import annotations

from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext, Serving, json_response
from tinyserve.api.openai.bodies import ModelCard, ModelList
from tinyserve.api.routing import model_not_found
from tinyserve.config import TenantConfig


class ModelRoutes:
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
