"""Tokenizers built from GGUF metadata (text/gguf_tokenizer.py) give the ids transformers'
GGUF loader gives, on 500 varied strings (Unicode, code, whitespace runs, digits, special
tokens in text), and decode them back the same: SmolLM2-135M-Instruct's byte-level BPE (the
real file; .ci/run fetches it), and SentencePiece vocabularies written here for a Llama, a
Gemma and a Phi-3 file (each family's own pre-tokenization)."""

import logging
import random
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tinyserve.text.tokenizer import Tokenizer  # noqa: E402

FRAGMENTS = [
    "Hello", "world", " the", "The quick brown fox", "jumps over", "lazy dog.", "café", "naïve",
    "Straße", "Ελληνικά", "русский", "日本語", "中文字符", "한국어", "😀", "👍🏽", "🇫🇷", "∑x²",
    "def f(x):", "return x ** 2", "if (a && b) { c++; }", "<div class=\"a\">", "{'k': [1, 2]}",
    "SELECT * FROM t;", "x_1 = y__2", "12345", "3.14159", "1,000,000", "2026-12-02", "0x1F",
    " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "...", "!?", "—", "'s", "'ll",
    "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<think>", "[INST]", "<0x41>", "▁", "\u200b",
]


def strings(n: int = 500, seed: int = 0) -> list[str]:
    g = random.Random(seed)
    out = ["", "a", " a", "a ", "  leading", "trailing  "]
    while len(out) < n:
        parts = g.choices(FRAGMENTS, k=g.randint(1, 8))
        out.append(g.choice(["", " ", "\n"]).join(parts))
    return out


def check_same(ours: Tokenizer, theirs, texts: list[str]) -> None:
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, False) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True), text


def test_smollm2_tokenizes_as_transformers(smollm2_file):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)
    ours = Tokenizer(smollm2_file)
    check_same(ours, theirs, strings())
    assert ours.bos_token == theirs.bos_token and ours.eos_token == theirs.eos_token
    assert ours.add_bos_token is False and ours.chat_template == theirs.chat_template
    assert ours.encode("hi") == theirs("hi")["input_ids"]


def _sentencepiece_file(path: Path, arch: str) -> Path:
    """A SentencePiece vocabulary as llama.cpp stores one: <unk>, <s>, </s>, 256 byte tokens,
    then pieces ("▁" for spaces) of a small corpus, scored by frequency (Gemma: by order)."""
    corpus = " ".join(strings(200, seed=1))
    counts: dict[str, int] = {}
    for word in corpus.replace("\n", " ").split(" "):
        piece = "▁" + word
        for i in range(len(piece)):
            for j in range(i + 1, min(len(piece), i + 6) + 1):
                counts[piece[i:j]] = counts.get(piece[i:j], 0) + 1
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = sorted((p for p in counts if (counts[p] > 1 or len(p) == 1) and p not in specials),
                    key=lambda p: (-counts[p], p))[:3000]
    tokens = specials + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_sentencepiece_vocabularies_tokenize_as_transformers(tmp_path, arch):
    path = _sentencepiece_file(tmp_path / "t.gguf", arch)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    ours = Tokenizer(path)
    check_same(ours, theirs, strings(500, seed=2))
    assert ours.add_bos_token and ours.bos_token == "<s>"
    assert ours.encode("hi")[0] == 1  # BOS added, as llama.cpp does
