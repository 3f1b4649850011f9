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

from tinyserve.formats.gguf import GGUFError, GGUFFile, show

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                          _LLAMA3_SPLIT),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT)}
# Rebuilding merges from scores: a split tried costs the token's length in characters sliced
# plus MERGE_COST (Python's own work, ~0.5 us); a merge found holds ~150 bytes. NOTE: SmolLM2's
# 49k tokens, were they scored, cost 12M (283k splits; 107k merges; 0.4 s); Gemma 3's 262k,
# longer, about 7x that: the limits leave it ~3x room. The worst a crafted vocabulary does (1M
# tokens of 16 characters, every split tried) reaches MERGE_WORK in 5.6M splits: 4.3 s, on 2
# cores shared with another job
MERGE_WORK, MERGE_COST, MAX_MERGES = 1 << 28, 32, 1 << 21


def gguf_tokenizer(path: str | Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """(the tokenizer, tokenizer_config.json's keys) of a GGUF model."""
    f = GGUFFile(path)
    tokens = f.items("tokenizer.ggml.tokens", str)
    if not tokens:
        raise GGUFError(f"{f.path}: no tokenizer.ggml.tokens: the file carries no tokenizer")
    kind = f.get("tokenizer.ggml.model", str)
    types = f.items("tokenizer.ggml.token_type", int) or []
    ids = f.special_ids(len(tokens))
    if kind == "gpt2":
        tok = _byte_level(f, tokens, _merge_pairs(f) or [], f.get("tokenizer.ggml.pre", str))
    elif kind == "llama":
        tok = _sentencepiece(f, tokens, f.items("tokenizer.ggml.scores", (int, float)),
                             _merge_pairs(f))
    else:
        raise GGUFError(f"{f.path}: tokenizer.ggml.model {show(kind)} is not supported "
                        "(gpt2, llama)")
    _add_special(tok, tokens, types, byte_level=kind == "gpt2")
    cfg: dict[str, Any] = {"chat_template": f.get("tokenizer.chat_template", str)}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        if key in ids:
            cfg[name] = tokens[ids[key]]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    cfg["add_bos_token"] = bool(f.get("tokenizer.ggml.add_bos_token", (bool, int),
                                      kind == "llama"))
    return tok, cfg


def _merge_pairs(f: GGUFFile) -> list[tuple[str, str]] | None:
    """tokenizer.ggml.merges ("left right" each) as pairs; None if the file has none."""
    merges = f.items("tokenizer.ggml.merges", str)
    if not merges:
        return None
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((i for i, p in enumerate(pairs) if len(p) != 2), None)
    if bad is not None:
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges[{bad}] is {show(merges[bad])}, not "
                        "two tokens joined by a space")
    return pairs


def _bpe(f: GGUFFile, vocab: dict[str, int], merges: list[tuple[str, str]],
         **options: Any) -> HFTokenizer:
    """The BPE model; what tokenizers refuses (a merge of unknown tokens) is the file's."""
    try:
        return HFTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, **options))
    except Exception as e:  # tokenizers raises a bare Exception
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges: {str(e)[:200]}") from e


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


def _byte_level(f: GGUFFile, tokens: list[str], pairs: list[tuple[str, str]],
                pre: str | None) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = _bpe(f, vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="",
               fuse_unk=False)
    split = SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tokens: list[str], scores: list[float] | None,
                   merges: list[tuple[str, str]] | None) -> HFTokenizer:
    arch = f.architecture
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:
        # Gemma stores a token of spaces as real spaces where its tokenizer looks up "▁"s, and
        # its merges follow the order of the vocabulary, not the scores
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    elif scores is None and not merges:
        raise GGUFError(f"{f.path}: a SentencePiece vocabulary without tokenizer.ggml.scores "
                        "or merges")
    else:
        ranks = dict(zip(tokens, scores or (), strict=False))
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = merges or _merges(tokens, vocab, ranks, f.path)
    # (an unk token the vocabulary lacks would fail every encode that needs it)
    tok = _bpe(f, vocab, pairs, fuse_unk=True, byte_fallback=True,
               unk_token="<unk>" if gemma and "<unk>" in vocab else None)
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


def _merges(tokens: list[str], vocab: dict[str, int], ranks: dict[str, float],
            path: Path) -> list[tuple[str, str]]:
    """The merges a scored vocabulary implies: every split of a token into two tokens, best
    scored first (ties: the longer left piece, then the longer right one, first).

    A split is tried only where both pieces' lengths are lengths of tokens (every split of
    every token is quadratic in a token's length: a token of 1M characters took minutes); the
    work is bounded by MERGE_WORK and the merges by MAX_MERGES, each holding the vocabulary's
    own strings (not slices: a merge costs the same whatever its length)."""
    lengths = {len(t) for t in vocab}
    found, work = [], 0
    for token, rank in ranks.items():
        n = len(token)
        cuts = [i for i in range(1, n) if i in lengths and n - i in lengths]
        work += len(cuts) * (n + MERGE_COST)  # (checked before slicing)
        if work > MERGE_WORK or len(found) > MAX_MERGES:
            raise GGUFError(f"{path}: tokenizer.ggml.tokens: rebuilding the merges from the "
                            f"scores takes more than {MERGE_WORK} units of work or "
                            f"{MAX_MERGES} merges (tinyserve's limits; real vocabularies take "
                            "under 100M and 1M)")
        ids = sorted((a, b) for i in cuts if (a := vocab.get(token[:i])) is not None
                     and (b := vocab.get(token[i:])) is not None)
        found.extend((tokens[a], tokens[b], rank) for a, b in ids)
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
