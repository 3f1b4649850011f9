"""tinyserve.text.grammar on the bundled stories260k tokenizer (512 ids, byte fallback).

The model's logits are taken as 520 wide, so ids 512-519 exist for the sampler but not for the
tokenizer: they must never be allowed.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tinyserve.text.grammar import KINDS, GrammarCompiler, GrammarSpec, Matcher, bitmask_words
from tinyserve.text.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "tinyserve" / "models" / "stories260k"
VOCAB = 520
EOS = 2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def comp(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, tok.eos_token_ids)


@pytest.fixture(scope="module")
def pieces(tok: Tokenizer) -> list[bytes | None]:
    """Each id's bytes; None for ids that no text is made of (special, or past the tokenizer)."""
    n = tok._tok.get_vocab_size()
    return [None if i >= n or i in tok.special_ids else bytes(tok.token_bytes(i)) for i in range(VOCAB)]


def mask(m: Matcher, vocab: int = VOCAB) -> tuple[bool, set[int]]:
    words = np.full((3, bitmask_words(vocab)), -1, dtype=np.int32)  # stale bits must be cleared
    ok = m.fill(words[1])
    bits = np.unpackbits(words[1].view(np.uint8), bitorder="little")
    return ok, set(np.flatnonzero(bits).tolist())


def walk(m: Matcher, pieces: list[bytes | None], rng: random.Random,
         limit: int = 3000) -> bytes:
    """A random allowed path to termination; ends quickly by taking EOS when allowed and,
    half the time, a token that closes something."""
    out = b""
    closers = {i for i, p in enumerate(pieces) if p in (b'"', b"}", b"]", b",")}
    for _ in range(limit):
        ok, allowed = mask(m)
        assert ok and allowed and all(pieces[t] for t in allowed - {EOS})
        if EOS in allowed:
            assert m.accept(EOS) and m.is_terminated
            return out
        near = sorted(allowed & closers)
        t = rng.choice(near) if near and rng.random() < 0.5 else rng.choice(sorted(allowed))
        assert m.accept(t)
        out += pieces[t]
    raise AssertionError(f"no termination after {limit} tokens: {out[:200]!r}")


def brute_force(language: list[bytes], prefix: bytes, pieces: list[bytes | None]) -> set[int]:
    allowed = {i for i, p in enumerate(pieces)
               if p and any(s.startswith(prefix + p) for s in language)}
    return allowed | ({EOS} if prefix in language else set())


@pytest.mark.parametrize("spec,language", [
    (GrammarSpec("choice", json.dumps(["no", "nope", "yes", "maybe so", 'a "q"\n'])),
     ["no", "nope", "yes", "maybe so", 'a "q"\n']),
    (GrammarSpec("regex", r"(ab|cd)[0-9]{2}( ok)?"),
     [a + f"{n:02d}" + s for a in ("ab", "cd") for n in range(100) for s in ("", " ok")]),
])
def test_masks_match_brute_force(comp, pieces, spec, language):
    language = [s.encode() for s in language]
    rng = random.Random(0)
    for _ in range(12):
        m, prefix = comp.matcher(spec), b""
        while True:
            ok, allowed = mask(m)
            assert ok and allowed == brute_force(language, prefix, pieces), prefix
            t = rng.choice(sorted(allowed))
            assert m.accept(t)
            if t == EOS:
                assert m.is_terminated and prefix in language
                break
            prefix += pieces[t]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_satisfies_schema(comp, pieces, seed):
    out = walk(comp.matcher(GrammarSpec("json_schema", json.dumps(SCHEMA))), pieces, random.Random(seed))
    jsonschema.validate(json.loads(out), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_json_object(comp, pieces, seed):
    assert isinstance(json.loads(walk(comp.matcher(GrammarSpec("json_object")), pieces,
                                      random.Random(seed))), dict)


def test_regex_and_choice_outputs(comp, pieces):
    pattern = r"[a-z]{3,8}@(example|test)\.(com|org)"
    choices = ["red", "green", "blue", "über"]
    rng = random.Random(1)
    for _ in range(8):
        assert re.fullmatch(pattern, walk(comp.matcher(GrammarSpec("regex", pattern)), pieces, rng).decode())
        out = walk(comp.matcher(GrammarSpec("choice", json.dumps(choices))), pieces, rng)
        assert out.decode() in choices


def test_lark_and_gbnf_grammars(comp, pieces):
    for text in ['start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/',
                 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [0-9][0-9]']:
        out = walk(comp.matcher(GrammarSpec("grammar", text)), pieces, random.Random(2)).decode()
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", out), out


@pytest.mark.parametrize("spec,words", [
    (GrammarSpec("json_schema", '{"type": "foo"}'), "foo"),
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1]"), "must be a JSON object"),
    (GrammarSpec("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'), "look-around"),
    (GrammarSpec("json_schema", '{"$ref": "#/defs/x"}'), "does not exist"),
    (GrammarSpec("regex", "(ab"), "unclosed group"),
    (GrammarSpec("choice", '["a", 1]'), "list of strings"),
    (GrammarSpec("grammar", 'start: "a" b\nb: foo'), "unknown name"),
    (GrammarSpec("grammar", "root ::= ("), "Expected ')'"),
    (GrammarSpec("xml", "<a/>"), "kind"),
])
def test_invalid_specs_raise(comp, spec, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        comp.compile(spec)
    msg = str(e.value)
    # the field at fault first; no Lark source quoted back, nor the options added to it
    assert msg.startswith(spec.kind if spec.kind in KINDS else "kind")
    assert "%llguidance" not in msg and " | " not in msg


@pytest.mark.parametrize("spec", [
    GrammarSpec("choice", "[]"),
    GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
    GrammarSpec("json_schema", '{"enum": []}'),
    GrammarSpec("grammar", 'start: a\na: a "x"'),  # a rule that never ends
])
def test_unsatisfiable_raises(comp, spec):
    with pytest.raises(ValueError):
        comp.compile(spec)


def test_dead_end_mid_output(comp, pieces):
    m = comp.matcher(GrammarSpec("grammar", 'start: "x" a\na: a "x"'))
    assert m.accept(pieces.index(b"x"))
    assert mask(m) == (False, set())
    assert not m.accept(EOS) and not m.is_terminated and m.num_accepted == 1


def test_ids_past_the_tokenizer(comp, tok):
    m = comp.matcher(GrammarSpec("json_object"))
    assert all(not m.accept(t) for t in (-1, 512, 519, VOCAB, *tok.special_ids - {EOS}))
    assert m.num_accepted == 0
    # narrower logits than the tokenizer: the mask is cut to them, and its padding bits stay 0
    narrow = GrammarCompiler(tok, 500, tok.eos_token_ids)
    m = narrow.matcher(GrammarSpec("regex", "[a-z ]+"))
    ok, allowed = mask(m, 500)
    assert ok and max(allowed) < 500 and not m.accept(505)


def test_eos_only_when_complete_and_every_eos_id(tok, pieces):
    comp = GrammarCompiler(tok, VOCAB, frozenset({EOS, 0}))
    m = comp.matcher(GrammarSpec("choice", '["ab", "abc"]'))
    for p in (b"a", b"b"):
        assert {EOS, 0}.isdisjoint(mask(m)[1])
        assert not m.accept(EOS) and m.accept(pieces.index(p))
    assert {EOS, 0} <= mask(m)[1] and not m.is_terminated  # "ab" may end, or go on to "abc"
    assert m.accept(pieces.index(b"c")) and m.is_terminated
    assert mask(m) == (True, {EOS, 0})
    assert not m.accept(pieces.index(b"a"))
    assert m.accept(0) and m.is_terminated and m.num_accepted == 4


def test_rollback_restores_masks(comp, pieces):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rng = random.Random(3)
    m = comp.matcher(spec)
    history = [(mask(m), m.is_terminated)]
    while True:
        allowed = history[-1][0][1]
        t = EOS if EOS in allowed and (m.num_accepted >= 30 or allowed == {EOS}) else \
            rng.choice(sorted(allowed - {EOS}))
        assert m.accept(t)
        history.append((mask(m), m.is_terminated))
        if t == EOS:  # then a second EOS, as a padded batch may sample
            assert m.is_terminated and m.accept(EOS)
            history.append((mask(m), m.is_terminated))
            break
    total = m.num_accepted
    for back in (1, 2, 1, 17, 5):
        m.rollback(back)
        assert m.num_accepted == total - back
        assert (mask(m), m.is_terminated) == history[m.num_accepted]
        total = m.num_accepted
    m.rollback(total)
    assert m.num_accepted == 0 and (mask(m), m.is_terminated) == history[0]
    with pytest.raises(ValueError):
        m.rollback(1)


@pytest.mark.parametrize("spec", [GrammarSpec("choice", '["ab", "abc", ""]'),
                                  GrammarSpec("regex", "[a-c]{1,4}"), GrammarSpec("json_object")])
def test_random_rollbacks_match_a_replay(comp, spec):
    """Accepting, rolling back and accepting again reaches the state of a fresh matcher fed the
    surviving tokens, EOS (and repeated EOS) included."""
    rng = random.Random(4)
    m, kept = comp.matcher(spec), []
    for _ in range(150):
        if kept and rng.random() < 0.3:
            back = rng.randint(1, len(kept))
            m.rollback(back)
            del kept[-back:]
        else:
            ok, allowed = mask(m)
            t = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(sorted(allowed))
            assert m.accept(t)
            kept.append(t)
        fresh = comp.matcher(spec)
        assert all(fresh.accept(t) for t in kept)
        assert (mask(m), m.is_terminated, m.num_accepted) == (mask(fresh), fresh.is_terminated, len(kept))


def test_only_the_empty_output(comp):
    m = comp.matcher(GrammarSpec("choice", '[""]'))
    assert m.is_terminated and mask(m) == (True, {EOS})
    assert m.accept(EOS) and m.accept(EOS) and m.is_terminated
    m.rollback(2)
    assert m.is_terminated and m.num_accepted == 0 and mask(m) == (True, {EOS})


def test_rollback_past_termination(comp, pieces):
    m = comp.matcher(GrammarSpec("choice", '["ab"]'))
    for p in (b"a", b"b"):
        assert m.accept(pieces.index(p))
    assert m.is_terminated and m.accept(EOS) and m.accept(EOS)
    for left in (3, 2):
        m.rollback(1)
        assert m.num_accepted == left and m.is_terminated and mask(m) == (True, {EOS})
    m.rollback(1)
    assert not m.is_terminated and mask(m)[1] == {i for i, p in enumerate(pieces) if p == b"b"}


def test_cache(tok):
    comp = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, cache_size=2)
    a, b, c = (GrammarSpec("regex", p) for p in ("a+", "b+", "c+"))
    first = comp.compile(a)
    assert comp.compile(GrammarSpec("regex", "a+")) is first
    comp.compile(b)
    comp.compile(a)  # a is now the most recent: c evicts b
    comp.compile(c)
    assert comp.compile(a) is first and comp.compile(b) is not None
    with ThreadPoolExecutor(4) as pool:  # racing compiles of one spec all get the cached one
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        assert len({id(g) for g in pool.map(comp.compile, itertools.repeat(spec, 8))}) == 1


def test_one_tenant_group_never_evicts_anothers_grammars(tok):
    comp = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, cache_size=2)
    mine = comp.compile(GrammarSpec("regex", "a+", scope="acme"))
    for i in range(10):  # another group floods the cache with schemas of its own
        comp.compile(GrammarSpec("regex", f"b{{{i + 1}}}", scope="bobco"))
    assert comp.compile(GrammarSpec("regex", "a+", scope="acme")) is mine  # still cached
    # the same spec in two groups is two entries: neither can tell whether the other used it
    assert comp.compile(GrammarSpec("regex", "a+", scope="bobco")) is not mine


def test_fill_rejects_a_wrong_buffer(comp):
    m = comp.matcher(GrammarSpec("json_object"))
    for bad in (np.zeros(bitmask_words(VOCAB), np.int64), np.zeros(bitmask_words(VOCAB) + 1, np.int32),
                np.zeros((bitmask_words(VOCAB), 2), np.int32)[:, 0]):
        with pytest.raises(ValueError):
            m.fill(bad)
    assert bitmask_words(1) == 1 and bitmask_words(32) == 1 and bitmask_words(33) == 2
