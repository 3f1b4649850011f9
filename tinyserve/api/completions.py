"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's two generate routes.

    auth -> decode (400 naming the field) -> route (``model`` names a served model or a
    --route alias; 404 if neither) -> with that model's parser: tools, prompt ids, sampling
    params, the vocabulary check, the grammar compiled (400 naming the field) -> a Job for
    the generate path, with the shaper that says what the answer looks like
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from tinyserve.api.auth import authenticate
from tinyserve.api.context import ApiContext, Serving, read_body
from tinyserve.api.errors import ApiError
from tinyserve.api.fields import decode_request
from tinyserve.api.generate import Generator, Job, check_before_compile
from tinyserve.api.info import Routed, route
from tinyserve.api.prompts import PromptParser, batch_of
from tinyserve.api.request_types import ChatCompletionRequest, CompletionRequest
from tinyserve.api.sampling import Generating, sampling_params
from tinyserve.api.shaping import ChatShaper, CompletionShaper, Shaper
from tinyserve.api.tools import ToolPlan
from tinyserve.api.tools import plan as tools_plan
from tinyserve.config import TenantConfig
from tinyserve.core.engine_core import check_sampling_vocabulary
from tinyserve.messages import FieldError, SamplingParams

if TYPE_CHECKING:
    from tinyserve.text.grammar import CompiledGrammar


class CompletionRoutes:
    def __init__(self, ctx: ApiContext, generator: Generator) -> None:
        self._ctx = ctx
        self._generator = generator

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ChatCompletionRequest)

    async def _generate(self, request: web.Request, kind: type[Generating]
                        ) -> web.StreamResponse:
        tenant = authenticate(request, self._ctx.cfg.tenant_list)
        serving = healthy(self._ctx)
        async with self._ctx.parsing:
            req = decode_request(await read_body(request), kind)
            routed, parser, (prompts, params, tools) = await prepare(serving, tenant, req)
        chat = isinstance(req, ChatCompletionRequest)
        if chat and req.stream and req.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is not supported with stream in chat "
                           "completions", param="prompt_logprobs", code="unsupported_parameter")
        return await self._generator.run(request, Job(
            prompts, params, req.n, tenant, routed.model, req.stream,
            _shaper(req, parser, params, prompts, tools), routed.adapter))


def healthy(ctx: ApiContext) -> Serving:
    """The loaded models, or a 503 (loading, or the supervisor saw a fatal fault)."""
    serving = ctx.serving_or_503()
    if serving.supervisor.failure:
        raise ApiError(503, f"the server is unhealthy: {serving.supervisor.failure}",
                       retry_after=5.0)
    return serving


async def prepare(serving: Serving, tenant: TenantConfig, req: Generating, admit: bool = True
                  ) -> tuple[Routed, PromptParser,
                             tuple[list[list[int]], SamplingParams, ToolPlan | None]]:
    """A decoded request -> the served model it routes to, that model's parser, and what
    ``parse`` makes of it there. The Responses and Messages APIs come here with the chat
    request they translate to. ``admit``: the request is to run, so the admission checks
    that need no grammar run before one is compiled (not for counting tokens)."""
    routed = route(serving, req.model, tenant, req.user)
    parser = serving.parsers[routed.model]

    def admissible(prompts: list[list[int]], params: SamplingParams) -> None:
        check_before_compile(serving, Job(prompts, params, req.n, tenant, routed.model, False,
                                          None))
    return routed, parser, await parse(parser, req, tenant.cache_salt.decode(),
                                       admissible if admit else None)


async def parse(parser: PromptParser, req: Generating, grammar_scope: str = "",
                before_compile: Callable[[list[list[int]], SamplingParams], None] | None = None
                ) -> tuple[list[list[int]], SamplingParams, ToolPlan | None]:
    """A decoded request routed to this model -> the token ids of its prompts (one, or a
    completions batch), its sampling parameters and its tools (chat). ``grammar_scope``: the
    tenant's cache group; ``before_compile``: the admission checks that can run before a
    grammar is compiled (raising ApiError), so a refused request costs no compile."""
    chat = isinstance(req, ChatCompletionRequest)
    tools = tools_plan(req.tools, req.tool_choice, parser.tool_parser,
                       req.parallel_tool_calls) if chat else None
    prompts = await parser.prompts(req, tools)
    params, grammar_field = sampling_params(req, parser.max_tokens_for(req, prompts), tools,
                                            grammar_scope)
    try:
        # (prompt_logprobs=-1 is bounded over the whole answer: every prompt, every choice)
        check_sampling_vocabulary(params, parser.vocab_size,
                                  req.n * sum(len(p) - 1 for p in prompts))
    except FieldError as e:
        raise ApiError.from_field(e) from None
    if params.guided is not None:
        if before_compile is not None:
            before_compile(prompts, params)
        compiled = await parser.check_grammar(params.guided, grammar_field)
        _check_bans_leave_a_start(compiled, params)
    return prompts, params, tools


def _check_bans_leave_a_start(compiled: CompiledGrammar, params: SamplingParams) -> None:
    """A grammar whose every first token logit_bias bans could only emit a banned token: a
    400 now, not an error after admission."""
    banned = {t for t, b in params.logit_bias if b <= -100.0}
    if banned and not compiled.first_allows_any(banned):
        raise ApiError(400, "logit_bias: its -100 bans leave none of the tokens the grammar "
                       "allows first, so nothing can be generated", param="logit_bias")


def _shaper(req: Generating, parser: PromptParser, params: SamplingParams,
            prompts: list[list[int]], tools: ToolPlan | None):
    """The response's shaper, once the answering model and the number of choices are known."""
    want = params.logprobs is not None
    tok = parser.tokenizer
    if isinstance(req, ChatCompletionRequest):
        return lambda model, choices: ChatShaper(req, model, tok, want, choices=choices,
                                                 prompts=prompts, tools=tools)
    echo = None
    if req.echo:  # the prompt as sent (a string), or its ids decoded (the ids are what ran),
        # special tokens kept as vLLM echoes them (a BOS sent as an id is "<s>" in the text)
        cut = req.truncate_prompt_tokens is not None
        echo = [(p if isinstance(p, str) and not cut else tok.decode(ids, False), ids)
                for p, ids in zip(batch_of(req.prompt), prompts, strict=True)]

    def shaper(model: str, choices: int) -> Shaper:
        return CompletionShaper(req, model, tok, want, choices=choices, prompts=prompts,
                                echo=echo)
    return shaper
