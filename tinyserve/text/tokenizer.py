"""Tokenizer: a model's Hugging Face ``tokenizer.json`` (via ``tokenizers``) or a GGUF file's
tokenizer, its special tokens and its chat template.

Pure Python plus the ``tokenizers`` extension: the control plane uses it without torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tinyserve.formats.gguf import is_gguf
from tinyserve.text.chat_template import ContentSpecials, compile_chat_template
from tinyserve.text.gguf_tokenizer import gguf_tokenizer
from tinyserve.text.stream_pieces import StreamPieces

log = logging.getLogger(__name__)

# Used when the model ships no chat template: role-tagged turns, then the assistant tag.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode plus the model's special ids and chat template."""

    def __init__(self, model: str | Path) -> None:
        """``model``: a Hugging Face directory (tokenizer.json, tokenizer_config.json) or a
        GGUF file (its tokenizer.ggml.* metadata: gguf_tokenizer.py)."""
        model = Path(model)
        if is_gguf(model):
            self._tok, cfg = gguf_tokenizer(model)
            source = self._tok.to_str().encode()
        else:
            path = model / "tokenizer.json"
            if not path.exists():
                raise FileNotFoundError(f"{path}: missing (a Hugging Face tokenizer.json is "
                                        "required)")
            self._tok = HFTokenizer.from_file(str(path))
            cfg_path = model / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
            source = path.read_bytes()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        # What transformers hands a chat template: the special tokens that are set.
        self.special_tokens = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token",
                                              "sep_token", "cls_token", "mask_token")
                               if (v := _token_str(cfg.get(k))) is not None}
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: frozenset[int] = frozenset([eos] if eos is not None else [])
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        # Models with one fingerprint turn a request into the same prompt ids: a fallback may
        # serve the prompt another model's tokenizer made.
        self.fingerprint = hashlib.sha256(b"\0".join((
            source, (template or "").encode(), str(self.bos_token).encode(),
            str(self.add_bos_token).encode()))).hexdigest()[:16]
        self._compiled_template = None
        self._token_text: dict[int, str] = {}
        self.special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        # No token stands for more characters than its piece has (byte-level pieces have one
        # character per byte, SentencePiece pieces one per character plus the "▁"): the API
        # rejects text longer than max_model_len of these without tokenizing it.
        self.max_token_chars = max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True))
        decoder = self._tok.get_added_tokens_decoder()
        self._content_specials = ContentSpecials([
            (decoder[i].content, decoder[i].lstrip, decoder[i].rstrip, decoder[i].normalized)
            for i in self.special_ids], self._normalize)
        # special-token text as text (built lazily), for a piece at the prompt's start or not
        self._plain_toks: dict[bool, HFTokenizer] = {}
        self._plain_lock = threading.Lock()
        # each plain token's text, for the detokenizer's fast path (stream_pieces.py)
        self.stream_pieces = StreamPieces(self._tok)

    def _normalize(self, text: str) -> str:
        norm = self._tok.normalizer
        return text if norm is None else norm.normalize_str(text)

    def add_eos_ids(self, ids: list[int] | tuple[int, ...]) -> None:
        self.eos_token_ids = self.eos_token_ids | frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode(self._tok, text, add_special_tokens)
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, with the leading space that a SentencePiece decode of the token
        alone strips (so that the pieces of a completion concatenate to its text)."""
        text = self._token_text.get(token_id)
        if text is None:
            piece = self._tok.id_to_token(token_id) or ""
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes (a byte-fallback piece <0xNN> is that one byte)."""
        piece = self._tok.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                pass
        return list(self.token_text(token_id).encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """Render messages with the model's jinja2 chat template (or the documented fallback),
        exactly as transformers' ``apply_chat_template`` does: the same sandbox, loop
        controls, ``tojson``, ``raise_exception``, ``strftime_now``, ``tools``, ``documents``
        and special-token variables."""
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(
                self.chat_template or FALLBACK_CHAT_TEMPLATE)
        try:
            return self._compiled_template.render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
                **template_kwargs)
        except Exception as e:  # template errors are the request's problem, not the server's
            raise ValueError(f"messages: the chat template rejected them: {e}") from e

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, parse_content_specials: bool = False,
                    **template_kwargs: Any) -> list[tuple[str, bool]]:
        """The chat prompt as (text, plain) pieces for ``encode_chat``: special-token text in
        any string of the request (messages, tools, template kwargs) is plain text (and the
        fallback template's markers cannot be written by content) unless
        ``parse_content_specials`` (transformers' and vLLM's way: the rendered prompt
        tokenized whole). See chat_template.ContentSpecials."""
        if parse_content_specials:
            return [(self.apply_chat_template(messages, add_generation_prompt, tools,
                                              **template_kwargs), False)]
        marked, (tools, template_kwargs), found = self._content_specials.mark(
            messages, self.chat_template is None, tools, template_kwargs)
        rendered = self.apply_chat_template(marked, add_generation_prompt, tools,
                                            **template_kwargs)
        return self._content_specials.pieces(rendered, found)

    def encode_chat(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """``render_chat``'s pieces -> ids (no BOS added: the template writes its own)."""
        ids: list[int] = []
        for i, (text, plain) in enumerate(pieces):
            ids += _encode(self._plain(at_start=i == 0) if plain else self._tok, text, False)
        return ids

    def _plain(self, at_start: bool) -> HFTokenizer:
        """A copy that tokenizes special-token text as text (its own object: the setting is
        per tokenizer, and worker threads encode with the shared one meanwhile)."""
        with self._plain_lock:
            tok = self._plain_toks.get(at_start)
            if tok is None:
                tok = HFTokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True
                # A piece after the prompt's start follows one of the template's special
                # tokens: a Metaspace that prefixes "▁" only at the start of the input must
                # not prefix it there (at the start it does, as the whole prompt's would).
                if not at_start and getattr(tok.pre_tokenizer, "prepend_scheme", None) == "first":
                    tok.pre_tokenizer.prepend_scheme = "never"
                self._plain_toks[at_start] = tok
            return tok


def _encode(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > 1024:  # encode_batch releases the GIL (encode does not): a worker thread
        # tokenizing a long prompt then does not stall the event loop
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids
