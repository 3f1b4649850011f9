"""Admin routes (tenants with ``admin = true``): the live route table, read and changed.

A change is one assignment on the event loop: requests already routed keep their model.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from tinyserve.api.auth import authenticate_admin
from tinyserve.api.context import ApiContext, Serving, json_response, read_body
from tinyserve.api.decode import decode_request
from tinyserve.api.errors import ApiError
from tinyserve.core.routing import describe

log = logging.getLogger(__name__)


class RouteUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/routes``: new weights for one --route alias, e.g.
    ``{"alias": "chat", "weights": {"a": 80, "b": 20}}``."""

    alias: str
    weights: dict[str, float]


class AdminRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    async def get_routes(self, request: web.Request) -> web.Response:
        authenticate_admin(request, self._ctx.cfg.tenant_list)
        return _table(self._ctx.serving_or_503())

    async def set_routes(self, request: web.Request) -> web.Response:
        """Change one alias's weights, live."""
        tenant = authenticate_admin(request, self._ctx.cfg.tenant_list)
        router = self._ctx.serving_or_503().router
        upd = decode_request(await read_body(request), RouteUpdate)
        if upd.alias not in router.routes:
            raise ApiError(404, f"no route named {upd.alias!r} (routes: "
                           f"{', '.join(router.routes) or 'none'})", param="alias")
        try:
            old = router.set_route(upd.alias, tuple(upd.weights.items()))
        except ValueError as e:
            raise ApiError(400, str(e), param="weights") from None
        log.warning("route %s: %s -> %s (by tenant %s)", upd.alias, describe(old),
                    describe(router.routes[upd.alias]), tenant.name)
        return _table(self._ctx.serving_or_503())


def _table(serving: Serving) -> web.Response:
    return json_response({"routes": serving.router.table(),
                          "fallbacks": serving.router.fallbacks})
