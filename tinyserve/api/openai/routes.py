"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's two generate routes on
the shared handler (``api/pipeline.py``); this module says what a body means and shapes the
answer (``completion.py``, ``chat.py``)."""

from __future__ import annotations

from aiohttp import web

from tinyserve.api.errors import ApiError
from tinyserve.api.openai.chat import ChatShaper
from tinyserve.api.openai.completion import CompletionShaper
from tinyserve.api.openai.fields import decode
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest
from tinyserve.api.pipeline import Call, GenerateRoutes
from tinyserve.api.prepare import Prepared
from tinyserve.api.prompts import batch_of
from tinyserve.api.shaper import Shaper
from tinyserve.config import TenantConfig


class CompletionRoutes(GenerateRoutes):
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, _completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, _chat)


def _completion(body: bytes, tenant: TenantConfig) -> Call:
    req = decode(body, CompletionRequest)

    def shaper(p: Prepared, model: str, choices: int, whole: bool) -> Shaper:
        tok, echo = p.parser.tokenizer, None
        if req.echo:  # the prompt as sent (a string), or its ids decoded (the ids are what
            # ran), special tokens kept as vLLM echoes them (a BOS sent as an id is "<s>")
            cut = req.truncate_prompt_tokens is not None
            echo = [(text if isinstance(text, str) and not cut else tok.decode(ids, False), ids)
                    for text, ids in zip(batch_of(req.prompt), p.prompts, strict=True)]
        return CompletionShaper(req, model, tok, p.params.logprobs is not None, choices=choices,
                                prompts=p.prompts, echo=echo, whole=whole)
    return Call(request=req, stream=req.stream, shaper=shaper)


def _chat(body: bytes, tenant: TenantConfig) -> Call:
    req = decode(body, ChatCompletionRequest)
    if req.stream and req.prompt_logprobs is not None:
        raise ApiError(400, "prompt_logprobs is not supported with stream in chat completions",
                       param="prompt_logprobs", code="unsupported_parameter")

    def shaper(p: Prepared, model: str, choices: int, whole: bool) -> Shaper:
        return ChatShaper(req, model, p.parser.tokenizer, p.params.logprobs is not None,
                          choices=choices, prompts=p.prompts, tools=p.tools, whole=whole)
    return Call(request=req, stream=req.stream, shaper=shaper)
