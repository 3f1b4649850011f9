"""The generate routes' one handler, for every API: each front only says what a body means
(``translate``: the chat or completion request it asks for, and how its answer is shaped).

    auth (401) -> healthy (503) -> [at most MAX_PARSING at once: read the body, translate
    (400 naming the field), prepare (route, prompts, params, grammar)] -> the generate path
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext, read_body
from tinyserve.api.errors import ApiError
from tinyserve.api.generate import Generator, Job
from tinyserve.api.prepare import Prepared, prepare
from tinyserve.api.sampling import Generating
from tinyserve.api.shaper import Shaper
from tinyserve.config import TenantConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """What a front makes of one request body."""

    request: Generating  # what runs: the chat or completion request it means
    stream: bool
    # (prepared, answering model, choices, whole) -> the answer's shaper
    shaper: Callable[[Prepared, str, int, bool], Shaper]
    # an error from the shared path, in this API's field names (None: the chat path's are)
    rename: Callable[[ApiError], ApiError] | None = None


Translate = Callable[[bytes, TenantConfig], Call]


async def handle(ctx: ApiContext, generator: Generator, request: web.Request,
                 translate: Translate) -> web.StreamResponse:
    tenant = authenticate(request, ctx.cfg.tenant_list)
    serving = ctx.healthy()
    async with ctx.parsing:
        call = translate(await read_body(request), tenant)
        try:
            prepared = await prepare(serving, tenant, call.request)
        except ApiError as e:
            raise (call.rename(e) if call.rename is not None else e) from None
    return await generator.run(request, Job(
        prepared=prepared, n=call.request.n, tenant=tenant, stream=call.stream,
        shaper=lambda model, choices, whole: call.shaper(prepared, model, choices, whole)))


class GenerateRoutes:
    """A front's routes: the handlers' shared context and the generate path they end in."""

    def __init__(self, ctx: ApiContext, generator: Generator) -> None:
        self._ctx = ctx
        self._generator = generator

    async def _generate(self, request: web.Request, translate: Translate) -> web.StreamResponse:
        return await handle(self._ctx, self._generator, request, translate)
