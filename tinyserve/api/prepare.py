"""A decoded request made ready to run, for every API (the Responses and Messages APIs come
here with the chat request they translate to):

    route (``model`` names a served model, an adapter or a --route alias; 404 if none)
    -> with that model's parser: tools, prompt ids, sampling params, the vocabulary check
    -> admission asked before a grammar is compiled (a refused request costs no compile)
    -> the grammar compiled (400 naming the field)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyserve.api.context import Serving
from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest
from tinyserve.api.prompts import PromptParser
from tinyserve.api.routing import route
from tinyserve.api.sampling import Generating, check_choices, sampling_params
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.api.tools.plan import plan as tools_plan
from tinyserve.config import TenantConfig
from tinyserve.core.adapters import AdapterSpec
from tinyserve.core.engine_core import check_sampling_vocabulary
from tinyserve.messages import FieldError, SamplingParams

if TYPE_CHECKING:
    from tinyserve.text.grammar import CompiledGrammar

Parsed = tuple[list[list[int]], SamplingParams, ToolPlan | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A request ready to submit: where it runs, and what."""

    model: str  # the served model it was routed to
    adapter: AdapterSpec | None  # the LoRA adapter it runs with (None: the base model)
    parser: PromptParser  # that model's
    prompts: list[list[int]]  # token ids, one list per prompt (a completions batch: several)
    params: SamplingParams
    tools: ToolPlan | None  # chat's tools and tool_choice


async def prepare(serving: Serving, tenant: TenantConfig, req: Generating, admit: bool = True
                  ) -> Prepared:
    """A decoded request -> the served model it routes to and what ``parse`` makes of it
    there. ``admit``: the request is to run, so admission is asked before a grammar is
    compiled (not when only counting tokens)."""
    routed = route(serving, req.model, tenant, req.user)
    parser = serving.parsers[routed.model]

    def admissible(prompts: list[list[int]], params: SamplingParams) -> None:
        check_choices(len(prompts), req.n)
        refusal = serving.admission.refuse_early(tenant.name, routed.model, prompts, req.n,
                                                 params.max_tokens)
        if refusal is not None:
            raise ApiError.from_failed(refusal)
    prompts, params, tools = await parse(parser, req, tenant.cache_salt.decode(),
                                         admissible if admit else None)
    return Prepared(model=routed.model, adapter=routed.adapter, parser=parser, prompts=prompts,
                    params=params, tools=tools)


async def parse(parser: PromptParser, req: Generating, grammar_scope: str = "",
                before_compile: Callable[[list[list[int]], SamplingParams], None] | None = None
                ) -> Parsed:
    """A decoded request routed to this model -> the token ids of its prompts (one, or a
    completions batch), its sampling parameters and its tools (chat). ``grammar_scope``: the
    tenant's cache group; ``before_compile``: the admission checks that can run before a
    grammar is compiled (raising ApiError), so a refused request costs no compile."""
    chat = isinstance(req, ChatCompletionRequest)
    tools = tools_plan(req.tools, req.tool_choice, parser.tool_parser,
                       req.parallel_tool_calls) if chat else None
    prompts = await parser.prompts(req, tools)
    params, grammar_field = sampling_params(req, parser.max_tokens_for(req, prompts), tools,
                                            grammar_scope, parser.vocab_size)
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
