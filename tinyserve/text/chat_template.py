"""Chat templates compiled as transformers compiles them, so a prompt renders to the same
text here as in ``tokenizer.apply_chat_template``."""

from __future__ import annotations

import json
from typing import Any


def compile_chat_template(source: str):
    """A chat template compiled in transformers' environment (chat_template_utils): jinja2's
    immutable sandbox with trim_blocks and lstrip_blocks, loop controls, a ``tojson`` that
    does not HTML-escape, ``raise_exception`` and ``strftime_now``."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
