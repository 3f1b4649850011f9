"""Decoding a request body: JSON -> its request struct (400 naming the field), and the
policy for fields OpenAI or vLLM define that tinyserve does not honour (yet), or that nobody
defines.

A client that sends ``tools`` or ``presence_penalty`` and gets a plausible answer that ignored
them has been lied to. So: a defined field tinyserve does not honour is accepted only with a
value that asks for nothing (``presence_penalty: 0``, ``tools: []``, ``response_format:
{"type": "text"}`` - what SDKs send by default), and is otherwise a 400 naming it. A field
neither defines is ignored, as OpenAI does, and logged once per name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from tinyserve.api.errors import ApiError
from tinyserve.api.request_types import ChatCompletionRequest, CompletionRequest, TokenizeRequest

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
    "logits_processors": _no_list, "priority": _number(0),
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
    "documents": _none, "chat_template": _none, "mm_processor_kwargs": _no_dict,
}

COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_SHARED,
    "suffix": _no_text, "add_special_tokens": _is(True),
}

TOKENIZE: dict[str, Callable[[Any], bool]] = {  # vLLM's /tokenize
    "continue_final_message": _is(False), "chat_template": _none,
    "mm_processor_kwargs": _no_dict,
}

# Top-level fields of OpenAI's and vLLM's requests that tinyserve honours (its structs),
# beyond the struct fields themselves: nothing to check, nothing to log.
_SEEN_LIMIT = 256  # names remembered for "logged once" (a client inventing keys is bounded)
_seen_unknown: set[str] = set()


def _top_level(body: bytes) -> dict[str, msgspec.Raw] | None:
    """The body's top-level keys and their raw values; None if it is not an object (the struct
    decode says why)."""
    try:
        return msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


# vLLM's chat token-in: what only a chat template reads means nothing for a prompt already
# templated, so sending any of these (whatever its value) beside prompt_token_ids is a 400
TEMPLATE_OPTIONS = ("chat_template", "chat_template_kwargs", "documents", "add_generation_prompt",
                    "continue_final_message", "add_special_tokens", "echo")


def _check_token_in(raw: dict[str, msgspec.Raw]) -> None:
    conflicts = sorted(k for k in TEMPLATE_OPTIONS if k in raw)
    if conflicts:
        raise ApiError(400, f"{conflicts} cannot be used with `prompt_token_ids`; pre-tokenized "
                       "input bypasses chat templating.", param="prompt_token_ids")


def _check_fields(raw: dict[str, msgspec.Raw], struct_fields: frozenset[str],
                  defined: dict[str, Callable]) -> None:
    """Raises ApiError(400) for a defined field asking for something not honoured; logs
    fields nobody defines once. Reads only the top-level keys' raw values."""
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


# The requests whose fields beyond the struct's are checked against a table above.
_TABLES: dict[type, dict[str, Callable[[Any], bool]]] = {
    ChatCompletionRequest: CHAT, CompletionRequest: COMPLETION, TokenizeRequest: TOKENIZE}


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """JSON body -> request struct; raises ApiError(400) naming the bad field."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"Invalid request: {e}", param=_bad_field(body, kind)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None
    except RecursionError:  # msgspec's guard against deep nesting
        raise ApiError(400, "Invalid JSON body: nested too deeply") from None
    table = _TABLES.get(kind)
    raw = _top_level(body) if table is not None else None
    if raw is not None:
        if kind is ChatCompletionRequest and req.prompt_token_ids:
            _check_token_in(raw)
        _check_fields(raw, frozenset(kind.__struct_fields__), table)
    return req


def _bad_field(body: bytes, kind: type[msgspec.Struct]) -> str | None:
    """The top-level field a body that failed to decode as ``kind`` got wrong, found as
    msgspec finds it: the first value, in the body's order (a repeated key's first value
    included), that does not convert to its field's type; else the first required field
    missing. Only on the error path: it parses the body again, field by field."""
    try:
        top = json.loads(body, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):
        return None
    if not isinstance(top, _Pairs):
        return None  # not an object: no field is at fault
    fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
    for name, value in top:
        if name in fields:
            try:
                msgspec.convert(_plain(value), type=fields[name].type)
            except (msgspec.ValidationError, RecursionError):
                return name
    given = {name for name, _ in top}
    return next((n for n, f in fields.items() if f.required and n not in given), None)


class _Pairs(list):
    """A JSON object as its (key, value) pairs, repeated keys kept."""


def _plain(value: Any) -> Any:
    if isinstance(value, _Pairs):
        return {k: _plain(v) for k, v in value}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
