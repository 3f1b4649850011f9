"""Which served model answers a request's ``model``: a served model, a LoRA adapter on its
base (another tenant's adapter is a 404, as if it did not exist), or a --route alias's
target, sticky per user within a tenant (else per tenant), so one user sees one version."""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.api.context import Serving
from tinyserve.api.errors import ApiError
from tinyserve.api.prompts import PromptParser
from tinyserve.config import TenantConfig
from tinyserve.core.adapters import AdapterSpec


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request goes: a served model, and the LoRA adapter on it (None: the base)."""

    model: str
    adapter: AdapterSpec | None = None


def route(serving: Serving, model: str, tenant: TenantConfig, user: str | None) -> Routed:
    """What answers ``model`` for this caller to run (404 if none): models that are down
    are routed around."""
    name = serving.router.resolve(model, _sticky_key(tenant, user), serving.admission.down_models())
    if name is None:
        raise model_not_found(model)
    if name in serving.parsers:
        return Routed(name)
    found = serving.adapter(name) if tenant.may_use(name) else None
    if found is None:
        raise model_not_found(model)
    return Routed(*found)


def parser_for(serving: Serving, model: str | None, tenant: TenantConfig,
               user: str | None = None) -> PromptParser:
    """The parser of the model a request for ``model`` would run on (None: the first served
    model), down models included: tokenizing needs no engine. An adapter tokenizes as its
    base."""
    if model is None:
        return next(iter(serving.parsers.values()))
    name = serving.router.resolve(model, _sticky_key(tenant, user), set())
    if name is not None and name not in serving.parsers:
        found = serving.adapter(name) if tenant.may_use(name) else None
        name = None if found is None else found[0]
    if name is None:
        raise model_not_found(model)
    return serving.parsers[name]


def _sticky_key(tenant: TenantConfig, user: str | None) -> str:
    """The key a --route alias's choice sticks to: one user within a tenant."""
    return f"{tenant.name}\0{user or ''}"
