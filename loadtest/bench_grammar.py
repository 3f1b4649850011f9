"""Host cost of grammar-constrained decoding: llguidance vs xgrammar.

    python loadtest/bench_grammar.py [--walks 5] [--big]

For llguidance, xgrammar and tinyserve.text.grammar (llguidance behind the module's API, with its
checks and bookkeeping), for each tokenizer and grammar it measures the compile time (spec -> a
ready matcher, the library's cache off) and the per-token host cost of constrained decoding:
fill the next-token bitmask, then accept the token, while walking through a valid output. The
output is tokenized by greedy longest match over the token bytes (the same ids for every
library; a model need not emit the canonical tokenization either). The first walk over a
compiled grammar is reported on its own ("cold"): llguidance builds its lexer lazily, so that
walk pays for part of the compile.

Tokenizers: the bundled stories260k (SentencePiece-style BPE with byte fallback, vocab 512) and a
32K byte-level BPE trained here on generated text, so nothing is downloaded (``--big``: a 128K
one too). The machine's core count matters: xgrammar compiles on up to 8 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# (appended: an installed package - Hugging Face's `kernels` - keeps its name over our kernels/)
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root

import numpy as np  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "tinyserve" / "models" / "stories260k"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "integer"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "age", "role", "address", "tags", "scores"],
    "additionalProperties": False,
}
SCHEMA_OUTPUT = json.dumps({
    "name": "Lily Park", "age": 34, "role": "editor",
    "address": {"street": "12 Garden Lane", "city": "Springfield", "zip": 12345},
    "tags": ["friendly", "curious", "tall"], "scores": [10, 25, 99, 3],
})
OBJECT_OUTPUT = json.dumps({
    "title": "The little red hen", "pages": 24, "rating": 4.5, "tags": ["farm", "bread"],
    "author": {"name": "Anon", "alive": False}, "notes": None,
})
REGEX = r"[A-Z][a-z]+( [a-z]+){2,15}\. Date: \d{4}-\d{2}-\d{2}, id=[a-f0-9]{8}"
REGEX_OUTPUT = "Once upon a time there was a little dog. Date: 2024-03-15, id=deadbeef"
CASES = [("json_object", OBJECT_OUTPUT), ("json_schema", SCHEMA_OUTPUT), ("regex", REGEX_OUTPUT)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel pre-tokenizer maps bytes to)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_bpe(vocab_size: int):
    """A byte-level BPE trained on generated story-ish text and JSON (a made-up language of
    syllable words: nearly every token is letters, so regexes over letters allow most of it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syll = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    scale = vocab_size // 32000
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3 + scale)))
             for _ in range(60000 * scale)]
    lines = []
    for _ in range(60000 * scale):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + ".")
        if rng.random() < 0.3:
            obj = {rng.choice(words): rng.choice([rng.randint(0, 99999), rng.choice(words),
                                                  [rng.randint(0, 99)], True, None])
                   for _ in range(rng.randint(1, 4))}
            lines.append(json.dumps(obj))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    table = [bytes(inv[c] for c in tok.id_to_token(i)) for i in range(tok.get_vocab_size())]
    eos = tok.token_to_id("<|endoftext|>")
    return tok, table, eos


def stories():
    from tinyserve.text.tokenizer import Tokenizer

    tk = Tokenizer(MODEL_DIR)
    table = [b"" if i in tk.special_ids else bytes(tk.token_bytes(i))
             for i in range(tk._tok.get_vocab_size())]
    return tk._tok, table, min(tk.eos_token_ids)


def greedy_tokenize(text: str, table: list[bytes]) -> list[int]:
    index = {b: i for i, b in enumerate(table) if b}
    longest = max(map(len, index))
    data, ids, pos = text.encode(), [], 0
    while pos < len(data):
        for n in range(min(longest, len(data) - pos), 0, -1):
            tid = index.get(data[pos:pos + n])
            if tid is not None:
                ids.append(tid)
                pos += n
                break
        else:
            raise ValueError(f"no token for byte {data[pos]!r}")
    return ids


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok, vocab: int, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(hf_tok.to_str(), n_vocab=vocab, eos_token=[eos])

    def compile(self, kind: str, value) -> object:
        # As tinyserve.text.grammar compiles them: no canonical-tokenization forcing (see there).
        body = {"json_object": '%json {"type": "object"}', "json_schema": f"%json {value}",
                "regex": f"/{self.llg.regex_to_lark(value)}/"}[kind]
        lark = '%llguidance {"no_forcing": true}\nstart: ' + body
        matcher = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def step(self, m, row: np.ndarray, tid: int) -> None:
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not m.consume_token(tid):
            raise AssertionError(m.get_error())


class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=hf_tok), vocab_size=vocab, stop_token_ids=[eos])
        self.comp = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, value) -> object:
        c = self.comp
        return {"json_object": lambda: c.compile_builtin_json_grammar(),
                "json_schema": lambda: c.compile_json_schema(value),
                "regex": lambda: c.compile_regex(value)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, row: np.ndarray, tid: int) -> None:
        m.fill_next_token_bitmask(row)
        if not m.accept_token(tid):
            raise AssertionError(f"token {tid} rejected")


class Module:
    """tinyserve.text.grammar itself: llguidance plus the wrapper's checks and bookkeeping."""

    name = "tinyserve.text.grammar"

    def __init__(self, hf_tok, vocab: int, eos: int) -> None:
        from types import SimpleNamespace

        from tinyserve.text import grammar

        self.g = grammar
        self.comp = grammar.GrammarCompiler(SimpleNamespace(_tok=hf_tok), vocab, frozenset([eos]),
                                            cache_size=0)

    def compile(self, kind: str, value) -> object:
        return self.comp.compile(self.g.GrammarSpec(kind, value or ""))

    def matcher(self, compiled):
        return self.g.Matcher(compiled)

    def step(self, m, row: np.ndarray, tid: int) -> None:
        m.fill(row)
        if not m.accept(tid):
            raise AssertionError(f"token {tid} rejected")


def walk(lib, compiled, ids: list[int], eos: int, masks: np.ndarray, times: list[float] | None) -> float:
    m = lib.matcher(compiled)
    row = masks[1]  # a row of a batch-shaped array, as the sampler will pass
    t_start = time.perf_counter()
    for tid in [*ids, eos]:
        t0 = time.perf_counter_ns()
        lib.step(m, row, tid)
        if times is not None:
            times.append((time.perf_counter_ns() - t0) / 1e3)
        assert (row[tid // 32] >> (tid % 32)) & 1, f"token {tid} was not allowed by the mask"
    return time.perf_counter() - t_start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--walks", type=int, default=5, help="timed walks per case (after the cold one)")
    ap.add_argument("--big", action="store_true", help="also a 128K-vocab BPE (about 30 s more)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    toks = [("stories260k", *stories()), ("bpe32k", *train_bpe(32000))]
    if args.big:
        toks.append(("bpe128k", *train_bpe(128000)))
    print(f"tokenizers ready in {time.perf_counter() - t0:.1f} s "
          f"(vocab {[t[0].get_vocab_size() for _, *t in toks]})\n")
    imports, libs, notes = {}, [], []
    for cls, mods in ((LLG, ("llguidance",)), (XGR, ("xgrammar", "transformers")), (Module, ())):
        t0 = time.perf_counter()
        try:
            for mod in mods:
                __import__(mod)
        except ImportError as e:  # only tinyserve.text.grammar's backend is a project dependency
            notes.append(f"{cls.name} skipped: {e}")
            continue
        imports[cls.name] = time.perf_counter() - t0
        libs.append(cls)
    rows = []
    for tok_name, hf_tok, table, eos in toks:
        vocab = hf_tok.get_vocab_size()
        outputs = {kind: greedy_tokenize(text, table) for kind, text in CASES}
        values = {"json_object": "", "json_schema": json.dumps(SCHEMA), "regex": REGEX}
        for cls in libs:
            t0 = time.perf_counter()
            lib = cls(hf_tok, vocab, eos)
            setup_ms = (time.perf_counter() - t0) * 1e3
            notes.append(f"{cls.name} tokenizer setup ({tok_name}): {setup_ms:.0f} ms")
            masks = np.zeros((4, (vocab + 31) // 32), dtype=np.int32)
            for kind, _ in CASES:
                compile_ms = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    compiled = lib.compile(kind, values[kind])
                    compile_ms.append((time.perf_counter() - t0) * 1e3)
                ids = outputs[kind]
                cold_s = walk(lib, compiled, ids, eos, masks, None)
                cold = cold_s / (len(ids) + 1) * 1e6
                request_ms = statistics.median(compile_ms) + cold_s * 1e3
                times: list[float] = []
                for _ in range(args.walks):
                    walk(lib, compiled, ids, eos, masks, times)
                times.sort()
                rows.append((cls.name, f"{tok_name} ({vocab})", kind, len(ids) + 1,
                             statistics.median(compile_ms), cold, request_ms, statistics.median(times),
                             times[int(0.95 * (len(times) - 1))]))
    # "new grammar ms": compile plus the first walk, what one request with an uncached spec pays
    print("| library | tokenizer | grammar | tokens | compile ms | cold walk µs/tok | new grammar ms | "
          "mask+accept µs/tok p50 | p95 |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, tok, kind, n, comp, cold, req, p50, p95 in rows:
        print(f"| {name} | {tok} | {kind} | {n} | {comp:.2f} | {cold:.1f} | {req:.2f} "
              f"| {p50:.1f} | {p95:.1f} |")
    print()
    for name, sec in imports.items():
        if name != Module.name:
            print(f"import {name}: {sec * 1e3:.0f} ms")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
