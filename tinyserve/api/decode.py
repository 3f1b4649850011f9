"""Decoding a request body, for every API: JSON -> its request struct (a 400 naming the field
at fault), then the policy for top-level fields beyond the struct that the API's owner
defines and this server does not honour.

A client that sends ``tools`` or ``presence_penalty`` and gets a plausible answer that ignored
them has been lied to. So each API keeps a table of the fields its owner (OpenAI, vLLM,
Anthropic) defines beyond the struct: such a field is accepted only with a value that asks for
nothing (``presence_penalty: 0``, ``tools: []`` - what SDKs send by default) and is otherwise
a 400 naming it. A field nobody defines is ignored, as the APIs' owners do (and logged once per
name, where the API asks for that).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tinyserve.api.errors import ApiError

log = logging.getLogger(__name__)

Neutral = Callable[[Any], bool]  # True: the value asks for nothing this server does not do
_SEEN_LIMIT = 256  # unknown names remembered for "logged once" (a client inventing keys: bounded)
_seen_unknown: set[str] = set()


# -- what asks for nothing -------------------------------------------------------------------

def none(v: Any) -> bool:
    return v is None


def equals(*neutral: Any) -> Neutral:
    """Neutral when None or equal to one of ``neutral`` (type-strict: False is not 0)."""
    def check(v: Any) -> bool:
        return v is None or any(type(v) is type(n) and v == n for n in neutral)
    return check


def number(neutral: float) -> Neutral:
    def check(v: Any) -> bool:
        return v is None or (isinstance(v, int | float) and not isinstance(v, bool)
                             and v == neutral)
    return check


def empty_list(v: Any) -> bool:
    return v is None or (isinstance(v, list) and not v)


def empty_dict(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and not v)


def empty_text(v: Any) -> bool:
    return v is None or v == ""


def anything(v: Any) -> bool:
    """Fields that cannot change the answer (storage, billing, tracing hints)."""
    return True


# -- decoding ---------------------------------------------------------------------------------

def decode_request(body: bytes, kind: type[msgspec.Struct],
                   defined: Mapping[str, Neutral] | None = None, log_unknown: bool = True) -> Any:
    """JSON body -> request struct; ApiError(400) naming the bad field. ``defined``: the
    fields beyond the struct that the API defines, each with what asks for nothing."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"Invalid request: {e}", param=_bad_field(body, kind)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None
    except RecursionError:  # msgspec's guard against deep nesting
        raise ApiError(400, "Invalid JSON body: nested too deeply") from None
    if defined is not None and (raw := top_level(body)) is not None:
        check_fields(raw, frozenset(kind.__struct_fields__), defined, log_unknown)
    return req


def top_level(body: bytes) -> dict[str, msgspec.Raw] | None:
    """The body's top-level keys and their raw values; None if it is not an object (the struct
    decode says why)."""
    try:
        return msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def raw_value(raw: msgspec.Raw) -> Any:
    """A raw top-level value decoded, or the Raw itself if it does not decode (then it asks
    for something: no neutral check accepts it)."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw


def check_fields(raw: Mapping[str, msgspec.Raw], struct_fields: frozenset[str],
                 defined: Mapping[str, Neutral], log_unknown: bool = True) -> None:
    """ApiError(400) for a defined field that asks for something not honoured. Reads only the
    top-level keys' raw values."""
    for name, value in raw.items():
        if name in struct_fields:
            continue
        neutral = defined.get(name)
        if neutral is None:
            if log_unknown:
                _log_unknown(name)
            continue
        if not neutral(raw_value(value)):
            raise ApiError(400, f"{name} is not supported by this server (only its default, "
                           f"which asks for nothing, is accepted)", param=name,
                           code="unsupported_parameter")


def _log_unknown(name: str) -> None:
    if name in _seen_unknown or len(_seen_unknown) >= _SEEN_LIMIT:
        return
    _seen_unknown.add(name)
    log.info("ignoring request field %r: the API does not define it", name[:64])


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
