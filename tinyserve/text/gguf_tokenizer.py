"""A ``tokenizers`` tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata, built as
transformers' GGUF loader builds it (so a GGUF model tokenizes here as there), and the
tokenizer_config.json keys that go with it (special tokens, add_bos_token, chat_template).

    tokenizer.ggml.model   what it is                     built as
    gpt2                   byte-level BPE with merges      BPE + ByteLevel (the split regex of
                                                           llama3 / qwen2 vocabularies by
                                                           tokenizer.ggml.pre; GPT-2's otherwise)
    llama                  SentencePiece BPE, scores       BPE with byte fallback, merges rebuilt
                                                           from the scores; Metaspace ("▁" first);
                                                           Gemma and Phi-3 each as transformers has
                                                           them (their notes below)

Tokens of type CONTROL become special added tokens, USER_DEFINED plain added ones, so neither
is cut into pieces when it appears in text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tinyserve.formats.gguf import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                          _LLAMA3_SPLIT),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT)}


def gguf_tokenizer(path: str | Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """(the tokenizer, tokenizer_config.json's keys) of a GGUF model."""
    f = GGUFFile(path)
    meta = f.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{f.path}: no tokenizer.ggml.tokens: the file carries no tokenizer")
    kind = meta.get("tokenizer.ggml.model")
    types = meta.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tok = _byte_level(tokens, meta.get("tokenizer.ggml.merges") or [],
                          meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        tok = _sentencepiece(tokens, meta.get("tokenizer.ggml.scores"),
                             meta.get("tokenizer.ggml.merges"), f.architecture)
    else:
        raise GGUFError(f"{f.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    _add_special(tok, tokens, types, byte_level=kind == "gpt2")
    cfg: dict[str, Any] = {"chat_template": meta.get("tokenizer.chat_template")}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= i < len(tokens):
            cfg[name] = tokens[i]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    return tok, cfg


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens in it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                   arch: str) -> HFTokenizer:
    if arch in ("gemma", "gemma2", "gemma3"):
        # Gemma stores a token of spaces as real spaces where its tokenizer looks up "▁"s, and
        # its merges follow the order of the vocabulary, not the scores
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    elif scores is None and not merges:
        raise GGUFError("a SentencePiece vocabulary without tokenizer.ggml.scores or merges")
    else:
        ranks = dict(zip(tokens, scores or (), strict=False))
    vocab = {t: i for i, t in enumerate(tokens)}
    gemma = arch in ("gemma", "gemma2", "gemma3")
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges(vocab, ranks)
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True,
                          byte_fallback=True, dropout=None, unk_token="<unk>" if gemma else None))
    if gemma:  # spaces -> "▁", no prefix, pieces end after each "▁"
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        return tok
    if arch == "phi3":  # the prefix "▁" from a normalizer: text starting with spaces keeps them
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return tok


def _merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a scored vocabulary implies: every split of a token into two tokens, best
    scored first (ties: the longer left piece, then the longer right one, first)."""
    found = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special(tok: HFTokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """CONTROL tokens as special added tokens (a byte-level one spelled outside the byte
    alphabet is a mislabel: skipped, as transformers does), USER_DEFINED as plain added ones."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
