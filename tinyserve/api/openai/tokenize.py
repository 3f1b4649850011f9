"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the ids a completion or chat request
would run (same template, same limits), and the text of ids, without running anything."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext, json_response, read_body
from tinyserve.api.openai.bodies import DetokenizeResponse, TokenizeResponse
from tinyserve.api.openai.fields import decode
from tinyserve.api.openai.requests import DetokenizeRequest, TokenizeRequest
from tinyserve.api.routing import parser_for

OFF_LOOP_IDS = 4096  # a tokenize answer with more ids is named and encoded off the loop


class TokenizeRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    async def tokenize(self, request: web.Request) -> web.Response:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        async with self._ctx.parsing:
            req = decode(await read_body(request), TokenizeRequest)
            parser = parser_for(serving, req.model, tenant, req.user)
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
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        async with self._ctx.parsing:
            req = decode(await read_body(request), DetokenizeRequest)
            parser = parser_for(serving, req.model, tenant)
            return json_response(DetokenizeResponse(await parser.detokenize(req.tokens)))
