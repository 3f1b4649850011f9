"""Tokenizer (Hugging Face ``tokenizer.json`` via ``tokenizers``) and incremental detokenizer.

Pure Python plus the ``tokenizers`` extension: the control plane uses it without torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

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

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: missing (a Hugging Face tokenizer.json is required)")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: frozenset[int] = frozenset([eos] if eos is not None else [])
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self._compiled_template = None
        self._token_text: dict[int, str] = {}

    def add_eos_ids(self, ids: list[int] | tuple[int, ...]) -> None:
        self.eos_token_ids = self.eos_token_ids | frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
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
                            add_generation_prompt: bool = True) -> str:
        """Render messages with the model's jinja2 chat template (or the documented fallback)."""
        if self._compiled_template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.StrictUndefined)
            env.globals["raise_exception"] = raise_exception
            source = self.chat_template or FALLBACK_CHAT_TEMPLATE
            self._compiled_template = env.from_string(source)
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except Exception as e:  # template errors are the request's problem, not the server's
            raise ValueError(f"messages: the chat template rejected them: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    Decodes a short window before the new tokens and emits only the difference, so tokenizers
    that strip or merge spaces at a decode boundary still produce the right text; a window that
    ends in U+FFFD is an unfinished multi-byte character and is held back. Stop strings are cut
    from the text, and text that might be the start of a stop string is held back from
    ``stream_delta`` until it is known not to be one.
    """

    WINDOW = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | tuple[int, ...],
                 stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids)
        self._prefix = max(len(self._ids) - self.WINDOW, 0)
        self._read = len(self._ids)
        self._stop = stop
        self._skip = skip_special_tokens
        self.text = ""  # all output text so far, cut at a matched stop string
        self.stopped = False  # a stop string matched
        self._streamed = 0  # chars of self.text already handed out by stream_delta

    def add(self, token_id: int) -> None:
        """Append one generated token; updates ``text`` and ``stopped``."""
        if self.stopped:
            return
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return
        start = len(self.text)
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        for s in self._stop:
            idx = self.text.find(s, max(0, start - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
                start = min(start, idx)  # an earlier stop string wins

    def stream_delta(self, final: bool = False) -> str:
        """New text safe to send: excludes a tail that could still grow into a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        delta = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def _held_back(self) -> int:
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if s.startswith(self.text[-n:]):
                    best = n
                    break
        return best
