"""Anthropic's Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``, on the
chat path: a Messages request becomes the ChatCompletionRequest it means (``request.py``),
goes through the shared handler (``api/pipeline.py``: routing, template, limits, grammar,
tenants, quotas, admission, aborts), and ``MessagesShaper`` says the answer in Anthropic's
words (``shaper.py``, ``types.py``). Errors, before or during a stream, are in Anthropic's
envelope (``api/errors.py``)."""

from __future__ import annotations

from aiohttp import web

from tinyserve.api.anthropic.request import chat_request, decode
from tinyserve.api.anthropic.shaper import MessagesShaper
from tinyserve.api.anthropic.types import CountTokensRequest, MessagesRequest, TokenCount
from tinyserve.api.auth import authenticate
from tinyserve.api.context import json_response, read_body
from tinyserve.api.pipeline import Call, GenerateRoutes
from tinyserve.api.prepare import Prepared, prepare
from tinyserve.api.shaper import Shaper
from tinyserve.config import TenantConfig


class MessagesRoutes(GenerateRoutes):
    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, _translate)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: the prompt's length as the same request would
        run it (system, tools and tool results included), checked as it would be."""
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.healthy()
        async with self._ctx.parsing:
            chat, _ = chat_request(decode(await read_body(request), CountTokensRequest))
            prepared = await prepare(serving, tenant, chat, admit=False)
        return json_response(TokenCount(len(prepared.prompts[0])))


def _translate(body: bytes, tenant: TenantConfig) -> Call:
    req = decode(body, MessagesRequest)
    chat, one_call = chat_request(req)

    def shaper(p: Prepared, model: str, choices: int, whole: bool) -> Shaper:
        return MessagesShaper(model, p.tools, one_call)
    return Call(request=chat, stream=req.stream, shaper=shaper)
