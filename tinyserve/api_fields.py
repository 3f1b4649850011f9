"""Request fields that OpenAI or vLLM define and tinyserve does not honour (yet), and fields
nobody defines.

A client that sends ``tools`` or ``presence_penalty`` and gets a plausible answer that ignored
them has been lied to. So: a defined field tinyserve does not honour is accepted only with a
value that asks for nothing (``presence_penalty: 0``, ``tools: []``, ``response_format:
{"type": "text"}`` - what SDKs send by default), and is otherwise a 400 naming it. A field
neither defines is ignored, as OpenAI does, and logged once per name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from tinyserve.protocol import ApiError

log = logging.getLogger(__name__)


def _none(v: Any) -> bool:
    return v is None


def _is(*neutral: Any) -> Callable[[Any], bool]:
    """Neutral when None or equal to one of ``neutral`` (type-strict: False is not 0)."""
    def check(v: Any) -> bool:
        return v is None or any(type(v) is type(n) and v == n for n in neutral)
    return check


def _number(neutral: float) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return v is None or (isinstance(v, int | float) and not isinstance(v, bool)
                             and v == neutral)
    return check


def _no_list(v: Any) -> bool:
    return v is None or (isinstance(v, list) and not v)


def _no_dict(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and not v)


def _no_text(v: Any) -> bool:
    return v is None or v == ""


def _anything(v: Any) -> bool:
    """Fields that cannot change the answer (storage, billing, tracing hints)."""
    return True


def _no_tool_choice(v: Any) -> bool:
    return v is None or v in ("none", "auto")


_SHARED: dict[str, Callable[[Any], bool]] = {
    # OpenAI
    "best_of": _number(1), "service_tier": _anything, "store": _anything,
    "metadata": _anything, "prompt_cache_key": _anything, "safety_identifier": _anything,
    # vLLM sampling extensions
    "min_p": _number(0),
    "bad_words": _no_list, "allowed_token_ids": _none,
    "use_beam_search": _is(False), "length_penalty": _number(1),
    "spaces_between_special_tokens": _is(True),
    "return_token_ids": _is(False), "logits_processors": _no_list, "priority": _number(0),
    "cache_salt": _none, "kv_transfer_params": _none, "vllm_xargs": _no_dict,
    "prompt_embeds": _none, "max_repetition_pattern_size": _number(0),
    "min_repetition_pattern_size": _number(0), "repetition_min_count": _number(0),
    "request_id": _anything, "guided_decoding_backend": _anything,
    "guided_whitespace_pattern": _none,
}

CHAT: dict[str, Callable[[Any], bool]] = {
    **_SHARED,
    "tools": _no_list, "tool_choice": _no_tool_choice, "parallel_tool_calls": _anything,
    "functions": _no_list, "function_call": _no_tool_choice, "modalities": _is(["text"]),
    "audio": _none, "prediction": _none, "reasoning_effort": _none,
    "web_search_options": _none, "verbosity": _none,
    # vLLM chat extensions
    "echo": _is(False), "add_generation_prompt": _is(True),
    "continue_final_message": _is(False), "add_special_tokens": _is(False),
    "documents": _none, "chat_template": _none, "chat_template_kwargs": _no_dict,
    "mm_processor_kwargs": _no_dict,
}

COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_SHARED,
    "suffix": _no_text, "add_special_tokens": _is(True),
}

TOKENIZE: dict[str, Callable[[Any], bool]] = {  # vLLM's /tokenize
    "continue_final_message": _is(False), "chat_template": _none,
    "chat_template_kwargs": _no_dict, "mm_processor_kwargs": _no_dict,
}

# Top-level fields of OpenAI's and vLLM's requests that tinyserve honours (its structs),
# beyond the struct fields themselves: nothing to check, nothing to log.
_SEEN_LIMIT = 256  # names remembered for "logged once" (a client inventing keys is bounded)
_seen_unknown: set[str] = set()


def check(body: bytes, struct_fields: frozenset[str], defined: dict[str, Callable]) -> None:
    """Raises ApiError(400) for a defined field asking for something not honoured; logs
    fields nobody defines once. Reads only the top-level keys' raw values."""
    try:
        raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return  # not an object: the struct decode says why
    for name, value in raw.items():
        if name == "stream_options":  # vLLM's rule: options only with a stream
            _check_stream_options(value, raw.get("stream"))
        if name in struct_fields:
            continue
        neutral = defined.get(name)
        if neutral is None:
            _log_unknown(name)
            continue
        try:
            v = msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError):
            v = value
        if not neutral(v):
            raise ApiError(400, f"{name} is not supported by this server (only its default, "
                           f"which asks for nothing, is accepted)", param=name,
                           code="unsupported_parameter")


def _log_unknown(name: str) -> None:
    if name in _seen_unknown or len(_seen_unknown) >= _SEEN_LIMIT:
        return
    _seen_unknown.add(name)
    log.info("ignoring request field %r: neither OpenAI nor vLLM defines it", name[:64])


def _check_stream_options(options: msgspec.Raw, stream: msgspec.Raw | None) -> None:
    try:
        given = msgspec.json.decode(options)
        streaming = stream is not None and msgspec.json.decode(stream) is True
    except (msgspec.DecodeError, RecursionError):
        return  # the struct decode names what is wrong
    if given and not streaming:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
