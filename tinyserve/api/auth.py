"""Who is asking: the tenant whose API key a request carries (``Authorization: Bearer``, or
``x-api-key`` as Anthropic's clients send it), compared in constant time over all keys; admin
routes need a tenant with ``admin = true``."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aiohttp import web

from tinyserve.api.access_log import ACCESS
from tinyserve.api.errors import ApiError
from tinyserve.config import TenantConfig


def find_tenant(tenants: Sequence[TenantConfig], authorization: str) -> TenantConfig | None:
    """The tenant whose key this ``Authorization`` header value carries, or None. With one
    keyless tenant (no --api-key, no tenants file) everyone is that tenant."""
    if len(tenants) == 1 and not tenants[0].api_key:
        return tenants[0]
    # aiohttp keeps undecodable header bytes as surrogates: encode them back, never raise
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    if not given:  # no key is empty (the tenants file refuses one): an empty bearer is no key
        return None
    found = None
    for t in tenants:  # no early exit: timing says nothing about which key is close
        if hmac.compare_digest(given, t.api_key.encode()) and scheme.lower() == "bearer":
            found = t
    return found


def authenticate(request: web.Request, tenants: Sequence[TenantConfig]) -> TenantConfig:
    """The request's tenant (401 if its key matches none), noted for its access line."""
    tenant = find_tenant(tenants, request.headers.get("Authorization", ""))
    if tenant is None and (key := request.headers.get("x-api-key")) is not None:
        tenant = find_tenant(tenants, "Bearer " + key)
    if tenant is None:
        raise ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer "
                       "<key>' or 'x-api-key: <key>')", code="invalid_api_key")
    if (access := request.get(ACCESS)) is not None:
        access.tenant = tenant.name
    return tenant


def authenticate_admin(request: web.Request, tenants: Sequence[TenantConfig]) -> TenantConfig:
    tenant = authenticate(request, tenants)
    if not tenant.admin:
        raise ApiError(403, f"tenant {tenant.name} may not use the admin routes (routes, LoRA "
                       "adapters: admin = true in the tenants file)", code="permission_denied")
    return tenant
