"""Chat templates compiled as transformers compiles them, so a prompt renders to the same
text here as in ``tokenizer.apply_chat_template``."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
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


# Special-token text in a chat request (issue 26): by default it is plain text, as OpenAI's
# tokenizer treats special-token text in user input, so no string a client sends -- message
# content, a name, a tool call's arguments, a tool's description or schema, a
# chat_template_kwargs value -- can end a turn, forge one, or stand for EOS; the template's
# own markers stay special ids.
#
#   content  "hi </s>"  -> before rendering: "hi \ue000<nonce>0\ue001" (a sentinel; whatever the
#                          template does to the string -- trim, split, tojson -- it does to
#                          the sentinel)
#   rendered "<s>[INST] hi \ue000<nonce>0\ue001 [/INST]"
#   pieces   ("<s>", parse) (" [INST] hi </s> [/INST]", plain)
#
# A plain piece is the text between two of the template's special tokens that holds a
# sentinel: tokenizers cut text at special tokens before anything else, so tokenizing it alone
# is what the whole prompt's tokenization does to it (a marker that strips the whitespace
# beside it strips it from the piece), with the special text kept as text. Text without a
# sentinel is tokenized as today, in one piece. A special token matched after normalization
# (normalized=True: NFKC makes "＜/s＞" "</s>") is looked for in each string normalized too; a
# string that holds one only then gets an empty sentinel: its whole piece is plain.
SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"


class ContentSpecials:
    """Marks special-token text in a request's strings and cuts the rendered prompt into
    pieces to tokenize with special tokens parsed (False) or not (True)."""

    def __init__(self, specials: list[tuple[str, bool, bool, bool]],
                 normalize: Callable[[str], str] | None = None) -> None:
        """specials: (text, lstrip, rstrip, normalized) of each special token; ``normalize``:
        the tokenizer's normalizer, for those matched after normalization."""
        texts = sorted({t for t, *_ in specials}, key=len, reverse=True)  # longest first
        self._specials = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._lstrip = {t for t, lstrip, _, _ in specials if lstrip}
        self._rstrip = {t for t, _, rstrip, _ in specials if rstrip}
        self._normalize = normalize if any(n for *_, n in specials) else None
        self._nonce = secrets.token_hex(6)  # a client cannot write a sentinel without it

    def mark(self, messages: list[dict[str, Any]], fallback: bool, *extra: Any
             ) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
        """(messages and each of ``extra`` (tools, template kwargs) with every special text
        in their strings, keys included, swapped for a sentinel; the special text of each
        sentinel). ``fallback``: the fallback template renders them, whose <|role|> markers
        are plain text in the vocabulary, so no tokenization can tell them from content:
        content's "<|" is written "<\\|" instead."""
        found: list[str] = []

        def sentinel(m: re.Match | None) -> str:
            found.append("" if m is None else m.group(0))
            return f"{SENTINEL_OPEN}{self._nonce}{len(found) - 1}{SENTINEL_CLOSE}"

        def walk(x: Any) -> Any:
            if isinstance(x, str):
                if self._specials is None:
                    return x
                marked = self._specials.sub(sentinel, x)
                if marked == x and self._normalize is not None \
                        and self._specials.search(self._normalize(x)):
                    marked = sentinel(None) + x  # special only once normalized: all plain
                return marked
            if isinstance(x, dict):
                return {walk(k): walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [walk(v) for v in x]
            return x

        out = []
        for m in messages:
            content = m.get("content")
            m = {k: v if k == "role" else walk(v) for k, v in m.items()}
            if isinstance(content, str):
                if fallback:
                    content = content.replace("<|", "<\\|")
                m["content"] = walk(content)
            out.append(m)
        return out, [walk(x) for x in extra], found

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
                # the markers beside it strip its edges as they would in the whole prompt
                if i > 0 and markers[i - 1] in self._rstrip:
                    text = text.lstrip()
                if i < len(markers) and markers[i] in self._lstrip:
                    text = text.rstrip()
                if parse:
                    out.append((parse, False))
                text = sentinels.sub(lambda m: found[int(m.group(1))], text)
                if text:
                    out.append((text, True))
                parse = ""
            else:
                parse += text
            if i < len(markers):
                parse += markers[i]
        if parse:
            out.append((parse, False))
        return out
