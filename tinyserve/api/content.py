"""Message content as text, for every API: a string, or a list of parts of the kinds the API
calls text, joined in order; any other part is a 400 naming where it is."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from tinyserve.api.errors import ApiError


def shown(v: Any) -> str:
    """A client's value in an error message, cut short."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def content_text(content: Any, kinds: Collection[str], where: str,
                 kind_of: Callable[[Any], Any], text_of: Callable[[Any], Any],
                 param: str = "messages") -> str:
    """A content value as one string: a string as it is, or a list of parts (``join_text``);
    anything else is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: must be a string or a list of {', '.join(kinds)} parts",
                       param=param)
    return join_text(content, kinds, where, kind_of, text_of, param)


def part_type(part: Any) -> Any:
    """A JSON part's ``type`` (None: not an object)."""
    return part.get("type") if isinstance(part, dict) else None


def join_text(parts: Sequence[Any], kinds: Collection[str], where: str,
              kind_of: Callable[[Any], Any], text_of: Callable[[Any], Any],
              param: str = "messages") -> str:
    """The parts' texts joined: each part's kind (``kind_of``) must be one of ``kinds`` and its
    text (``text_of``) a string (None: empty). ``where``: the parts' place in the request (an
    error names the part's index in it)."""
    texts = []
    for j, part in enumerate(parts):
        kind = kind_of(part)
        if kind not in kinds:
            raise ApiError(400, f"{where}[{j}]: content parts of type {shown(kind)} are not "
                           f"supported ({', '.join(kinds)} only)", param=param,
                           code="unsupported_parameter")
        text = text_of(part)
        if text is not None and not isinstance(text, str):
            raise ApiError(400, f"{where}[{j}]: a {kind} part needs a string", param=param)
        texts.append(text or "")
    return "".join(texts)
