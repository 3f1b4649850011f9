"""Issue 26, findings 1-3, below the server: large choice lists run to a valid choice (one
lexeme, not a 2,000-item parser row), the choice-count and grammar-size limits, the compiled
grammar cache bounded in bytes per tenant group and in all, and a step that never draws a
token its request bans (grammar + logit_bias -100 + min_tokens leaving nothing)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tinyserve.core.engine_core import check_sampling_vocabulary
from tinyserve.engine.running.logits_processing import LogitsProcessors
from tinyserve.messages import FieldError, GrammarSpec, SamplingParams, ScheduledSeq
from tinyserve.text.grammar import MAX_CHOICES, GrammarCompiler, bitmask_words
from tinyserve.text.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "tinyserve" / "models" / "stories260k"
VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def comp(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, tok.eos_token_ids)


def choice(values: list[str], scope: str = "") -> GrammarSpec:
    import json
    return GrammarSpec("choice", json.dumps(values), scope=scope)


def greedy_walk(comp: GrammarCompiler, tok: Tokenizer, spec: GrammarSpec, pick) -> str:
    """Follow the masks to termination, taking pick(allowed ids) each step."""
    m = comp.matcher(spec)
    ids = []
    for _ in range(200):
        words = np.zeros(bitmask_words(VOCAB), np.int32)
        assert m.fill(words), f"dead end after {ids}: {m.error}"
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        t = EOS if EOS in allowed else pick(allowed)
        assert m.accept(t)
        if t == EOS:
            return tok.decode(ids)
        ids.append(int(t))
    raise AssertionError("no termination")


@pytest.mark.parametrize("n", [1999, 2001, 30_000])
def test_large_choice_lists_end_on_a_choice(comp, tok, n):
    # the list: 30,000 values "n64_{i}_zzz..."; at 2,001+ alternatives the Earley
    # parser failed after the first token (max_items_in_row 2000)
    values = [f"n64_{i}_" + "z" * 30 for i in range(n)]
    for pick in (lambda a: int(a[-1]), lambda a: int(a[len(a) // 2])):
        assert greedy_walk(comp, tok, choice(values), pick) in set(values)


def test_choice_count_limit(comp, tok):
    at = [f"c{i}" for i in range(MAX_CHOICES)]
    assert greedy_walk(comp, tok, choice(at), lambda a: int(a[-1])) in set(at)
    with pytest.raises(ValueError, match=f"limit of {MAX_CHOICES}"):
        comp.compile(choice(at + ["x"]))


def test_cache_bounded_in_bytes_per_group_and_in_all(tok):
    comp = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, cache_bytes=20 << 20,
                           scope_cache_bytes=8 << 20, max_grammar_bytes=4 << 20)
    for i in range(12):  # each ~3.3 MiB estimated
        comp.compile(choice([f"v{i}_{j}" for j in range(10_000)], scope=f"t{i % 3}"))
        assert comp.cached_bytes <= 20 << 20
        assert all(b <= 8 << 20 for b in comp._scope_bytes.values())
    mine = comp.compile(GrammarSpec("regex", "a+", scope="small"))
    assert comp.compile(GrammarSpec("regex", "a+", scope="small")) is mine
    with pytest.raises(ValueError, match="limit of 4 MiB"):  # refused before compiling
        comp.compile(choice([f"w{j}" for j in range(30_000)]))


def seq(params: SamplingParams, output: tuple[int, ...] = (), banned: tuple[int, ...] = ()
        ) -> ScheduledSeq:
    return ScheduledSeq(7, (1,), 0, (), True, params, 0, output_ids=output, banned=banned)


def outcome(comp, params: SamplingParams, banned: tuple[int, ...] = ()):
    lp = LogitsProcessors(VOCAB, (EOS,), torch.device("cpu"))
    lp.grammars = comp
    s = [seq(params, banned=banned)]
    return lp.dead_ends(s, *lp.grammar_masks(s)).get(0)


def test_bans_that_leave_nothing_end_the_request(comp):
    az = GrammarSpec("regex", "[a-z]+")
    # the issue: regex [a-z]+ with -100 on ids 3..511 drew <unk> (0), which the regex forbids
    end = outcome(comp, SamplingParams(guided=az, logit_bias=tuple((t, -100.0) for t in range(3, 512))))
    assert end[0] == "nothing_allowed" and "logit_bias" in end[1]
    everything = tuple((t, -100.0) for t in range(VOCAB))
    assert outcome(comp, SamplingParams(logit_bias=everything))[0] == "nothing_allowed"
    # only min_tokens bans EOS: the request may end there, so it does
    assert outcome(comp, SamplingParams(logit_bias=tuple((t, -100.0) for t in range(VOCAB) if t != EOS),
                                        min_tokens=3), banned=(EOS,)) == EOS
    # something left: sampled as usual
    assert outcome(comp, SamplingParams(guided=az, logit_bias=((0, -100.0),))) is None


def test_a_failed_grammar_is_an_error_not_an_end(comp):
    class Broken:
        def matcher(self, spec):
            raise RuntimeError("boom")
    end = outcome(Broken(), SamplingParams(guided=GrammarSpec("regex", "a+")))
    assert end[0] == "grammar" and "structured output" in end[1]


def test_all_banned_from_the_start_is_refused():
    with pytest.raises(FieldError, match="bans every token"):
        check_sampling_vocabulary(SamplingParams(logit_bias=tuple((t, -100.0) for t in range(VOCAB))), VOCAB)
    check_sampling_vocabulary(SamplingParams(logit_bias=tuple((t, -100.0) for t in range(1, VOCAB))), VOCAB)


@pytest.mark.parametrize("n", [3, 3000])
def test_a_choice_list_holding_the_empty_string(comp, tok, n):
    # "" cannot be part of a lexeme: it made each value a parser rule again, and past 2,000
    # the matcher failed mid-output
    values = [""] + [f"c{i}" for i in range(n)]
    for pick in (lambda a: int(a[-1]), lambda a: int(a[0])):
        assert greedy_walk(comp, tok, choice(values), pick) in set(values)
    m = comp.matcher(choice(values))
    words = np.zeros(bitmask_words(VOCAB), np.int32)
    assert m.fill(words) and np.unpackbits(words.view(np.uint8), bitorder="little")[EOS]
    assert greedy_walk(comp, tok, choice([""]), lambda a: int(a[0])) == ""


def test_a_full_lexer_ends_one_request_and_leaves_the_cache(tok):
    """The lexer's automaton is built lazily inside the cached grammar and grows with what
    outputs explore: bounded by MAX_LEXER_STATES (a 16-byte regex grew one to 150 MB under
    llguidance's default); past it the request ends with reason "grammar" and the grammar
    leaves the cache, so the next request compiles it afresh instead of failing at once."""
    import random
    comp = GrammarCompiler(tok, VOCAB, tok.eos_token_ids)
    lp = LogitsProcessors(VOCAB, (EOS,), torch.device("cpu"))
    lp.grammars = comp
    spec = GrammarSpec("regex", "(a|b)*a(a|b){20}")
    first = comp.compile(spec)
    rng = random.Random(0)
    failure = None
    for seq_id in range(2000):
        out: list[int] = []
        for _ in range(1500):
            s = ScheduledSeq(seq_id, (1,), 0, (), True, SamplingParams(guided=spec), 0,
                             output_ids=tuple(out))
            masks, failed = lp.grammar_masks([s])
            if failed:
                failure = failed[0]
                break
            allowed = [t for t in np.flatnonzero(np.unpackbits(
                masks[0].view(np.uint8), bitorder="little")[:VOCAB]) if t != EOS]
            out.append(int(rng.choice(allowed)))
            lp.advance([s], [out[-1]])
        lp.forget([seq_id])
        if failure is not None:
            break
    assert failure is not None and failure[0] == "grammar" and "too many states" in failure[1]
    assert comp.compile(spec) is not first  # compiled afresh: a new request runs
    s = ScheduledSeq(99_999, (1,), 0, (), True, SamplingParams(guided=spec), 0, output_ids=())
    assert lp.grammar_masks([s])[1] == {}


def test_concurrent_requests_for_one_spec_compile_it_once(tok, monkeypatch):
    import threading
    import time
    comp = GrammarCompiler(tok, VOCAB, tok.eos_token_ids)
    calls = []
    compile_ = comp._compile

    def slow(spec):
        calls.append(spec)
        time.sleep(0.2)  # every other request arrives while this one compiles
        return compile_(spec)
    monkeypatch.setattr(comp, "_compile", slow)
    results, errors = [], []

    def request(spec):
        try:
            results.append(comp.compile(spec))
        except ValueError as e:
            errors.append(str(e))
    good, bad = choice([f"v{i}" for i in range(100)]), GrammarSpec("regex", "(")
    threads = [threading.Thread(target=request, args=(s,)) for s in [good] * 6 + [bad] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls.count(good) == 1 and len(results) == 6 and len({id(r) for r in results}) == 1
    assert calls.count(bad) == 1 and len(errors) == 3 and len(set(errors)) == 1
    assert not comp._compiling
