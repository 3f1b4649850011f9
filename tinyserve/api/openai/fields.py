"""OpenAI's and vLLM's fields beyond tinyserve's request structs, and what of each asks for
nothing (``api/decode.py`` has the policy): a field on these tables is accepted only with
that value, anything else is a 400 naming it; a field on none is ignored and logged once.

Also vLLM's two shape rules the structs cannot say: ``stream_options`` only with a stream,
and no template option beside ``prompt_token_ids`` (a prompt already templated).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tinyserve.api.decode import (
    Neutral,
    anything,
    check_fields,
    decode_request,
    empty_dict,
    empty_list,
    empty_text,
    equals,
    none,
    number,
    raw_value,
    top_level,
)
from tinyserve.api.errors import ApiError
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest, TokenizeRequest


def _no_tool_choice(v: Any) -> bool:
    return v is None or v in ("none", "auto")


_SHARED: dict[str, Neutral] = {
    # OpenAI
    "best_of": number(1), "service_tier": anything, "store": anything,
    "metadata": anything, "prompt_cache_key": anything, "safety_identifier": anything,
    # vLLM sampling extensions
    "min_p": number(0),
    "bad_words": empty_list, "allowed_token_ids": none,
    "use_beam_search": equals(False), "length_penalty": number(1),
    "spaces_between_special_tokens": equals(True),
    "logits_processors": empty_list, "priority": number(0),
    "cache_salt": none, "kv_transfer_params": none, "vllm_xargs": empty_dict,
    "prompt_embeds": none, "max_repetition_pattern_size": number(0),
    "min_repetition_pattern_size": number(0), "repetition_min_count": number(0),
    "request_id": anything, "guided_decoding_backend": anything,
    "guided_whitespace_pattern": none,
}

CHAT: dict[str, Neutral] = {
    **_SHARED,
    "tools": empty_list, "tool_choice": _no_tool_choice, "parallel_tool_calls": anything,
    "functions": empty_list, "function_call": _no_tool_choice, "modalities": equals(["text"]),
    "audio": none, "prediction": none, "reasoning_effort": none,
    "web_search_options": none, "verbosity": none,
    # vLLM chat extensions
    "echo": equals(False), "add_generation_prompt": equals(True),
    "continue_final_message": equals(False), "add_special_tokens": equals(False),
    "documents": none, "chat_template": none, "mm_processor_kwargs": empty_dict,
}

COMPLETION: dict[str, Neutral] = {
    **_SHARED,
    "suffix": empty_text, "add_special_tokens": equals(True),
}

TOKENIZE: dict[str, Neutral] = {  # vLLM's /tokenize
    "continue_final_message": equals(False), "chat_template": none,
    "mm_processor_kwargs": empty_dict,
}

_TABLES: dict[type, dict[str, Neutral]] = {
    ChatCompletionRequest: CHAT, CompletionRequest: COMPLETION, TokenizeRequest: TOKENIZE}

# vLLM's chat token-in: what only a chat template reads means nothing for a prompt already
# templated, so sending any of these (whatever its value) beside prompt_token_ids is a 400
TEMPLATE_OPTIONS = ("chat_template", "chat_template_kwargs", "documents", "add_generation_prompt",
                    "continue_final_message", "add_special_tokens", "echo")


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """JSON body -> an OpenAI / vLLM request struct; a 400 naming the field at fault."""
    req = decode_request(body, kind)
    table = _TABLES.get(kind)
    if table is None or (raw := top_level(body)) is None:
        return req
    if kind is ChatCompletionRequest and req.prompt_token_ids:
        conflicts = sorted(k for k in TEMPLATE_OPTIONS if k in raw)
        if conflicts:
            raise ApiError(400, f"{conflicts} cannot be used with `prompt_token_ids`; "
                           "pre-tokenized input bypasses chat templating.",
                           param="prompt_token_ids")
    if "stream_options" in raw:
        _check_stream_options(raw["stream_options"], raw.get("stream"))
    check_fields(raw, frozenset(kind.__struct_fields__), table)
    return req


def _check_stream_options(options: msgspec.Raw, stream: msgspec.Raw | None) -> None:
    """vLLM's rule: options only with a stream."""
    given = raw_value(options)
    if isinstance(given, msgspec.Raw):
        return  # the struct decode names what is wrong
    if given and not (stream is not None and raw_value(stream) is True):
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
