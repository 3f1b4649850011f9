"""Each token's text where a decode is just concatenation: the incremental detokenizer's fast
path, a dictionary lookup a token instead of a window decode (about 3 us of a streamed
token's host time, the largest single piece of it).

A decode is concatenation at a boundary between two *plain* tokens - not added or special,
not a byte-fallback piece, and whole UTF-8 characters on their own - for the decoders the
models we serve use: ByteLevel (GPT-2's bytes; a token that is whole characters by itself
starts on a lead byte, so whatever precedes it, its text is its own), SentencePiece's
Replace("▁", " ") + ByteFallback + Fuse + Strip (bytes are grouped only across consecutive
byte pieces, the strip only touches the start of the text) and Metaspace (likewise). Each
token's text is read once from a decode after an ASCII anchor token. Anything else - another
decoder, a neighbour that is not plain - takes the detokenizer's window decode as before.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer as HFTokenizer

_MISSING = object()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SENTENCEPIECE_STEPS = {"Replace", "ByteFallback", "Fuse", "Strip"}


def _concatenative(decoder: dict | None) -> bool:
    """The decoders whose output at a plain/plain boundary is the two sides' texts joined."""
    if decoder is None:
        return False
    kind = decoder.get("type")
    if kind in ("ByteLevel", "Metaspace"):
        return True
    if kind != "Sequence":
        return False
    for step in decoder.get("decoders", ()):
        t = step.get("type")
        if t not in _SENTENCEPIECE_STEPS:
            return False
        if t == "Replace" and (step.get("pattern") != {"String": "\u2581"}
                               or step.get("content") != " "):
            return False
        if t == "Strip" and (step.get("content") != " " or step.get("stop", 0) != 0
                             or step.get("start", 0) > 1):
            return False
    return True


class StreamPieces:
    """``text(token_id)``: the token's text after any plain token, or None when it is not
    plain itself (or the decoder is not one of those above). Filled lazily, shared by every
    request of the model (dict reads and writes are atomic: no lock on the hot path)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._texts: dict[int, str | None] = {}
        self._anchor: tuple[int, str] | None = None
        decoder = json.loads(tok.to_str()).get("decoder")
        if _concatenative(decoder):
            self._added = frozenset(tok.get_added_tokens_decoder())
            for word in ("a", " a", "the", " the"):
                ids = tok.encode(word, add_special_tokens=False).ids
                if len(ids) == 1 and ids[0] not in self._added:
                    text = tok.decode(ids, skip_special_tokens=False)
                    if text and text.isascii() and text.strip():
                        self._anchor = (ids[0], text)
                        break

    @property
    def enabled(self) -> bool:
        return self._anchor is not None

    def text(self, token_id: int) -> str | None:
        got = self._texts.get(token_id, _MISSING)
        if got is _MISSING:
            got = self._texts[token_id] = self._read(token_id)
        return got

    def _read(self, token_id: int) -> str | None:
        if self._anchor is None or token_id in self._added:
            return None
        piece = self._tok.id_to_token(token_id)
        if piece is None or _BYTE_PIECE.fullmatch(piece):
            return None
        anchor, anchor_text = self._anchor
        joined = self._tok.decode([anchor, token_id], skip_special_tokens=False)
        if not joined.startswith(anchor_text):
            return None
        text = joined[len(anchor_text):]
        if not text or "\ufffd" in text:  # nothing, or not whole characters by itself
            return None
        return text
