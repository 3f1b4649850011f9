"""OpenAI wire types (msgspec Structs) and the error envelope.

Requests decode straight into these types; unknown fields are ignored (clients send many we
do not use). ``to_sampling_params`` is the one place where API fields become engine fields.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any, Literal

import msgspec

from tinyserve.messages import MAX_LOGIT_BIAS, MAX_LOGPROBS, GrammarSpec, SamplingParams

MAX_N = 64  # choices per request (n x prompts: each is a request to admission)


class ApiError(Exception):
    """An error to return in the OpenAI envelope with this HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(ErrorInfo(
            self.message, self.TYPES.get(self.status, "invalid_request_error"
                                         if self.status < 500 else "server_error"),
            self.param, self.code)))


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------

class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (refused when true)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, TGI)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): for benchmarks
    stop_token_ids: list[int] | None = None  # extension (vLLM): stop on these tokens
    skip_special_tokens: bool = True  # extension (vLLM): special tokens out of the text
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    repetition_penalty: float | None = None  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM): logprobs of the prompt's tokens
    include_stop_str_in_output: bool = False  # extension (vLLM)
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs name token ids
    truncate_prompt_tokens: int | None = None  # extension (vLLM): keep the prompt's last k
    # structured output: OpenAI's response_format, or one of vLLM's guided_* / structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by tools.plan
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: one call at most ("required")


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch (a list of either)
    logprobs: int | None = None
    echo: bool = False


# Requests whose fields beyond the struct's are checked by tinyserve.api_fields (its tables).
_API_FIELD_TABLES = {"ChatCompletionRequest": "CHAT", "CompletionRequest": "COMPLETION",
                     "TokenizeRequest": "TOKENIZE"}

_PARAM_RE = re.compile(r"at `\$\.([A-Za-z_]+)|missing required field `([A-Za-z_]+)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """JSON body -> request struct; raises ApiError(400) naming the bad field."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PARAM_RE.search(str(e))
        param = (m.group(1) or m.group(2)) if m else None
        raise ApiError(400, f"Invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None
    except RecursionError:  # msgspec's guard against deep nesting
        raise ApiError(400, "Invalid JSON body: nested too deeply") from None
    table = _API_FIELD_TABLES.get(kind.__name__)
    if table is not None:
        from tinyserve import api_fields

        api_fields.check(body, frozenset(kind.__struct_fields__), getattr(api_fields, table))
        options = getattr(req, "stream_options", None)
        if options is not None and options.continuous_usage_stats:
            raise ApiError(400, "stream_options.continuous_usage_stats is not supported by "
                           "this server", param="stream_options", code="unsupported_parameter")
    return req


def message_text(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for p in msg.content:
        if p.type != "text":
            raise ApiError(400, f"content part type {p.type!r} is not supported (text only)",
                           param="messages")
        parts.append(p.text or "")
    return "".join(parts)


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                       vocab_size: int) -> SamplingParams:
    """API fields -> engine fields; every value bounded here (400 naming the field)."""
    if req.top_k is not None and req.top_k > vocab_size:
        raise ApiError(400, f"top_k must be -1, 0 (disabled) or at most the vocabulary size "
                       f"{vocab_size}, got {req.top_k}", param="top_k")
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.stop_token_ids and not all(0 <= t < vocab_size for t in req.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be token ids in the vocabulary "
                       f"[0, {vocab_size})", param="stop_token_ids")
    if isinstance(req, ChatCompletionRequest):
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be <= {MAX_LOGPROBS}", param="top_logprobs")
    else:
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        # the echoed prompt's tokens carry logprobs too (as many alternatives as the output's)
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed, stop=req.stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab_size), min_tokens=req.min_tokens,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            guided=guided_spec(req))
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), param=field) from None


def guided_spec(req: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
    """The one structured-output constraint a request asks for (400 if several)."""
    asked = guided_field(req)
    return asked[1] if asked else None


def guided_field(req: ChatCompletionRequest | CompletionRequest
                 ) -> tuple[str, GrammarSpec] | None:
    """(the field that asks for it, the constraint), or None."""
    asked: list[tuple[str, GrammarSpec]] = []
    rf = req.response_format
    if rf is not None and rf.get("type") != "text":
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(("response_format", GrammarSpec("json_object")))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format: json_schema.schema must be a JSON object",
                               param="response_format")
            asked.append(("response_format", GrammarSpec("json_schema", _json(schema))))
        else:
            raise ApiError(400, f"response_format: type must be text, json_object or "
                           f"json_schema, got {str(kind)[:40]!r}", param="response_format")
    if req.guided_json is not None:
        value = req.guided_json if isinstance(req.guided_json, str) else _json(req.guided_json)
        asked.append(("guided_json", GrammarSpec("json_schema", value)))
    for name, kind, value in (("guided_regex", "regex", req.guided_regex),
                              ("guided_grammar", "grammar", req.guided_grammar)):
        if value is not None:
            asked.append((name, GrammarSpec(kind, value)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", GrammarSpec("choice", _json(req.guided_choice))))
    so = req.structured_outputs or {}
    unknown = [k for k, v in so.items() if k not in _STRUCTURED and v not in (None, False)]
    if unknown:
        raise ApiError(400, f"structured_outputs.{unknown[0][:40]} is not supported by this "
                       "server", param="structured_outputs", code="unsupported_parameter")
    for key, kind in _STRUCTURED.items():
        value = so.get(key)
        if value is None or value is False:
            continue
        if kind == "json_object":
            value = ""
        elif not isinstance(value, str):
            value = _json(value)
        asked.append(("structured_outputs", GrammarSpec(kind, value)))
    if len(asked) > 1:
        raise ApiError(400, f"ask for one structured output, not {len(asked)} "
                       f"({', '.join(n for n, _ in asked)})", param=asked[1][0])
    return asked[0] if asked else None


_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries",
                       param="logit_bias")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id in the vocabulary "
                           f"[0, {vocab_size})", param="logit_bias")
        if not math.isfinite(value):
            raise ApiError(400, "logit_bias values must be finite numbers", param="logit_bias")
        out.append((token, value))
    return tuple(out)


# -- responses --------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # None: an echoed prompt's first token
    text_offset: list[int]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    created: int = msgspec.field(default_factory=now)
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET  # vLLM's extension


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChunkChoice]
    created: int
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class PromptLogprob(msgspec.Struct):
    """vLLM's entry for one candidate of a prompt position (``prompt_logprobs``)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, else token id (as text) ->
# its entry, for the prompt's own token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[CompletionChoice]
    created: int
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct):
    """One entry of ``GET /v1/models``, with vLLM's extra fields (benchmark clients read
    ``max_model_len`` and ``root``)."""

    id: str
    max_model_len: int
    root: str = ""  # the checkpoint it serves (for a --route alias: the alias)
    parent: str | None = None
    created: int = msgspec.field(default_factory=now)
    object: Literal["model"] = "model"
    owned_by: str = "tinyserve"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: a completion ``prompt`` or chat ``messages``."""

    model: str | None = None  # default: the first served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: default on; messages: off (the template)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False
    user: str | None = None  # picks a --route alias's target as a completion's would
    tools: list[Any] | None = None  # messages only: handed to the chat template, as in chat


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class RouteUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/routes``: new weights for one --route alias, e.g.
    ``{"alias": "chat", "weights": {"a": 80, "b": 20}}``."""

    alias: str
    weights: dict[str, float]


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
