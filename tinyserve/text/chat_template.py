"""Chat templates compiled as transformers compiles them, so a prompt renders to the same
text here as in ``tokenizer.apply_chat_template``."""

from __future__ import annotations

import json
import re
import secrets
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


# Special-token text in chat message content (issue 26): by default it is plain text, as
# OpenAI's tokenizer treats special-token text in user input, so content cannot end a turn,
# forge one, or stand for EOS; the template's own markers stay special ids.
#
#   content  "hi </s>"  -> before rendering: "hi \ue000<nonce>0\ue001" (a sentinel; whatever the
#                          template does to content -- trim, split -- it does to the sentinel)
#   rendered "<s>[INST] hi \ue000<nonce>0\ue001 [/INST]"
#   pieces   ("<s>", parse) (" [INST] hi </s> [/INST]", plain)
#
# A plain piece is the text between two of the template's special tokens that holds content
# special text: tokenizers cut text at special tokens before anything else, so tokenizing it
# alone is what the whole prompt's tokenization does to it, with the special text kept as
# text. Text without a sentinel is tokenized as today, in one piece.
SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"


class ContentSpecials:
    """Marks special-token text in message content and cuts the rendered prompt into pieces
    to tokenize with special tokens parsed (False) or not (True)."""

    def __init__(self, special_texts: list[str]) -> None:
        texts = sorted(set(special_texts), key=len, reverse=True)  # longest first, as tokenizers
        self._specials = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._nonce = secrets.token_hex(6)  # content cannot make a sentinel without it

    def mark(self, messages: list[dict[str, Any]],
             fallback: bool) -> tuple[list[dict[str, Any]], list[str]]:
        """(messages with content specials as sentinels, the special text of each sentinel).
        ``fallback``: the fallback template renders them, whose <|role|> markers are plain text
        in the vocabulary, so no tokenization can tell them from content: content's "<|" is
        written "<\\|" instead."""
        found: list[str] = []

        def sentinel(m: re.Match) -> str:
            found.append(m.group(0))
            return f"{SENTINEL_OPEN}{self._nonce}{len(found) - 1}{SENTINEL_CLOSE}"

        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                if fallback:
                    content = content.replace("<|", "<\\|")
                if self._specials is not None:
                    content = self._specials.sub(sentinel, content)
                m = {**m, "content": content}
            out.append(m)
        return out, found

    def pieces(self, rendered: str, found: list[str]) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, plain) pieces; sentinels back to their text."""
        if not found:
            return [(rendered, False)]
        sentinels = re.compile(f"{SENTINEL_OPEN}{self._nonce}(\\d+){SENTINEL_CLOSE}")
        # [text, special, text, special, ..., text]: specials here are the template's own
        parts = self._specials.split(rendered) if self._specials else [rendered]
        markers = self._specials.findall(rendered) if self._specials else []
        out: list[tuple[str, bool]] = []
        parse = ""  # what is tokenized as today, up to the next piece holding a sentinel
        for i, text in enumerate(parts):
            if sentinels.search(text):
                if parse:
                    out.append((parse, False))
                out.append((sentinels.sub(lambda m: found[int(m.group(1))], text), True))
                parse = ""
            else:
                parse += text
            if i < len(markers):
                parse += markers[i]
        if parse:
            out.append((parse, False))
        return out
