"""Request -> sampling parameters: the one place where API fields become engine fields.

Three kinds of check, each in one place: the request's shape here (``n``, ``top_logprobs``
without ``logprobs``, a ``logit_bias`` key that is not a token id, one structured-output field
at most, and each token id a request names: in the model's vocabulary, the refusal naming the
id, before it is a ``SamplingParams``); value ranges in ``messages.SamplingParams``; the rest of
the vocabulary's limits in the engine core (``core.engine_core.check_sampling_vocabulary``, run
before the request is submitted, so a bad value is a 400 before any stream starts). Every
refusal names the request's own field.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest
from tinyserve.api.tools.plan import ToolPlan
from tinyserve.core.engine_core import check_token_ids
from tinyserve.messages import (
    FULL_VOCAB,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    FieldError,
    GrammarSpec,
    SamplingParams,
)

MAX_N = 64  # choices per request (n x prompts: each is a request to admission)
# a logit_bias key: a token id in decimal (40 digits shows any id, bounds int()'s work)
_TOKEN_KEY = re.compile(r"-?[0-9]{1,40}")

Generating = ChatCompletionRequest | CompletionRequest


def sampling_params(req: Generating, max_tokens: int, tools: ToolPlan | None = None,
                    grammar_scope: str = "", vocab_size: int | None = None
                    ) -> tuple[SamplingParams, str | None]:
    """The request's sampling parameters, and the field that asked for structured output
    (``tool_choice`` when the tools force one), or None. ``grammar_scope``: the tenant's
    cache group (its compiled grammars are cached apart from other groups'); ``vocab_size``:
    the routed model's, which every token id the request names must be in (None: the
    engine core checks them, naming no id)."""
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                           f"{req.top_logprobs}", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if not chat and req.echo and req.logprobs is not None and prompt_logprobs != FULL_VOCAB:
        # the echoed prompt's tokens carry logprobs too (as many alternatives as the output's)
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    asked = guided_field(req)
    guided, field = asked if asked else (None, None)
    if tools is not None and tools.guided is not None:
        if guided is not None:
            raise ApiError(400, "tool_choice \"required\" or a named function is itself a "
                           "structured output: send no other", param="tool_choice")
        guided, field = tools.guided, "tool_choice"
    if guided is not None:
        guided = msgspec.structs.replace(guided, scope=grammar_scope)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed, stop=req.stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
            stop_token_ids=_token_ids(req.stop_token_ids, "stop_token_ids", vocab_size),
            skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab_size), min_tokens=req.min_tokens,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, guided=guided,
            return_token_ids=bool(req.return_token_ids))
    except FieldError as e:
        raise ApiError.from_field(e) from None
    return params, field


def check_choices(num_prompts: int, n: int) -> None:
    """Every choice of a request is a request to admission: at most MAX_N of them."""
    if num_prompts * n > MAX_N:
        raise ApiError(400, f"n: {num_prompts} prompts x n={n} is more than {MAX_N} choices "
                       "per request", param="n")


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: vLLM's seed + j, so each choice differs yet reproduces."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j) % 2**64)


def guided_field(req: Generating) -> tuple[GrammarSpec, str] | None:
    """The one structured-output constraint a request asks for and the field that asks for
    it, or None (400 if several)."""
    asked: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            asked.append((spec, "response_format"))
    if req.guided_json is not None:
        value = req.guided_json if isinstance(req.guided_json, str) else _json(req.guided_json)
        asked.append((GrammarSpec("json_schema", value), "guided_json"))
    for name, kind, value in (("guided_regex", "regex", req.guided_regex),
                              ("guided_grammar", "grammar", req.guided_grammar)):
        if value is not None:
            asked.append((GrammarSpec(kind, value), name))
    if req.guided_choice is not None:
        asked.append((GrammarSpec("choice", _json(req.guided_choice)), "guided_choice"))
    asked += [(spec, "structured_outputs") for spec in _structured_outputs(
        req.structured_outputs or {})]
    if len(asked) > 1:
        raise ApiError(400, f"ask for one structured output, not {len(asked)} "
                       f"({', '.join(n for _, n in asked)})", param=asked[1][1])
    return asked[0] if asked else None


def _response_format(rf: dict[str, Any]) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format: json_schema.schema must be a JSON object",
                           param="response_format")
        return GrammarSpec("json_schema", _json(schema))
    raise ApiError(400, f"response_format: type must be text, json_object or json_schema, "
                   f"got {str(kind)[:40]!r}", param="response_format")


_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}


def _structured_outputs(so: dict[str, Any]) -> list[GrammarSpec]:
    """vLLM's ``structured_outputs``: one spec per key that asks for something."""
    unknown = [k for k, v in so.items() if k not in _STRUCTURED and v not in (None, False)]
    if unknown:
        raise ApiError(400, f"structured_outputs.{unknown[0][:40]} is not supported by this "
                       "server", param="structured_outputs", code="unsupported_parameter")
    specs = []
    for key, kind in _STRUCTURED.items():
        value = so.get(key)
        if value is None or value is False:
            continue
        if kind == "json_object":
            value = ""
        elif not isinstance(value, str):
            value = _json(value)
        specs.append(GrammarSpec(kind, value))
    return specs


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _token_ids(ids: list[int] | None, field: str, vocab_size: int | None) -> tuple[int, ...]:
    if not ids:
        return ()
    if vocab_size is not None:
        try:
            check_token_ids(ids, vocab_size, field)
        except FieldError as e:
            raise ApiError.from_field(e) from None
    return tuple(ids)


def _logit_bias(bias: dict[str, float] | None,
                vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """The JSON object's keys as token ids: decimal integers (not int()'s "1_0", " 5" or
    other scripts' digits), in the vocabulary."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:  # (before looking at each key)
        raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries",
                       param="logit_bias")
    out = []
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id",
                           param="logit_bias")
        if not math.isfinite(value):
            raise ApiError(400, "logit_bias values must be finite numbers", param="logit_bias")
        out.append((int(key), value))
    _token_ids([t for t, _ in out], "logit_bias", vocab_size)
    return tuple(out)
