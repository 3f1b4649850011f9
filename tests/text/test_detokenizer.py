"""IncrementalDetokenizer on the real stories260k tokenizer.

1. Against a naive reference that decodes the whole output after every token, finds the earliest
   stop-string occurrence and holds back the longest suffix that is a prefix of a stop string.
2. Per-call work: decode calls, Python lines run and bytes allocated per step stay flat over a
   5,000-token output, and do not grow from a 16-char to a 256-char stop string.
"""

import statistics
import sys
import tracemalloc

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import STORIES_DIR
from tinyserve.text import detokenizer as tokenizer_module
from tinyserve.text.detokenizer import IncrementalDetokenizer
from tinyserve.text.tokenizer import Tokenizer

BYTE_BASE = 3  # <0x00> .. <0xFF> are ids 3 .. 258 in the Llama-2 style vocab
FIRST_PIECE, LAST_PIECE = 259, 511  # ordinary merged pieces ("▁t", "he", ...)
SPECIAL = (0, 1, 2)  # <unk>, <s>, </s>

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her big red ball. One day, she saw a small bird sitting on a tree. The bird was "
    "sad because it could not fly. Lily wanted to help the bird, so she asked her mom for some "
    "bread. They gave the bird the bread and it was very happy. The next day, the bird could fly "
    "again! Lily and the bird became best friends and they played together every day. "
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if not (STORIES_DIR / "tokenizer.json").exists():
        pytest.skip(f"stories260k tokenizer not found at {STORIES_DIR}")
    return Tokenizer(STORIES_DIR)


# -- 1. against the naive reference ------------------------------------------------------------

def reference_steps(tok: Tokenizer, prompt: list[int], out: list[int], stops: list[str],
                    skip: bool) -> list[tuple[bool, str, str, bool]]:
    """After each token: (stopped, text, safe text to stream, settled), whole-output decodes.

    ``settled``: the decode does not end in an unfinished character, so the detokenizer has
    seen all of it. The list ends at the token that matches a stop string.
    """
    head = tok.decode(prompt, skip)
    steps = []
    for k in range(1, len(out) + 1):
        full = tok.decode(prompt + out[:k], skip)
        assert full.startswith(head)
        full = full[len(head):]
        hits = [full.find(s) for s in stops if s in full]
        if hits:
            text = full[:min(hits)]
            steps.append((True, text, text, True))
            break
        hold = max((n for s in stops for n in range(1, len(s)) if full.endswith(s[:n])),
                   default=0)
        steps.append((False, full, full[:len(full) - hold], not full.endswith("\ufffd")))
    return steps


def char_tokens(c: str) -> list[int]:
    return [BYTE_BASE + b for b in c.encode("utf-8")]


# A unit of output is one ordinary or special token, or one whole character spelled in
# byte-fallback tokens (1 to 4 of them). Only whole characters: a window that starts inside an
# invalid byte run decodes it differently from the whole text, which is the windowed decode's
# existing behaviour and not what this test is about.
units = st.one_of(
    st.integers(FIRST_PIECE, LAST_PIECE).map(lambda t: [t]),
    st.sampled_from(SPECIAL).map(lambda t: [t]),
    st.text("ab", min_size=1, max_size=6).map(  # runs of a's and b's for overlapping stops
        lambda s: [t for c in s for t in char_tokens(c)]),
    st.characters(codec="utf-8", exclude_characters="\ufffd").map(char_tokens),
    st.sampled_from("é€😀").map(char_tokens),
)
stop_alphabet = st.sampled_from(["a", "b", " ", "e", "the", "é", "€", "😀"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_whole_text_reference(tok, data):
    prompt = data.draw(st.sampled_from([[], [1], tok.encode("Once upon a time, Lily")]))
    out = [t for u in data.draw(st.lists(units, min_size=1, max_size=40)) for t in u]
    skip = data.draw(st.booleans())
    whole = tok.decode(prompt + out, skip)[len(tok.decode(prompt, skip)):]
    kinds = [
        st.lists(stop_alphabet, min_size=1, max_size=5).map("".join),
        st.text("ab", min_size=2, max_size=6),  # "aaab", "abab", ...: self-overlapping
        st.text(min_size=1, max_size=6),
    ]
    if whole:  # substrings of the output, so that stops actually match, at random places,
        # or with a char appended, so that they mostly match only in part and are held back
        substring = st.integers(0, len(whole) - 1).flatmap(
            lambda i: st.integers(1, 12).map(lambda n: whole[i:i + n]))
        kinds += [substring, st.tuples(substring, st.sampled_from("#a")).map("".join)]
    stop_strings = st.one_of(kinds).filter(lambda s: "\ufffd" not in s)
    stops = data.draw(st.lists(stop_strings, max_size=4))
    calls = data.draw(st.lists(st.booleans(), min_size=len(out), max_size=len(out)))

    steps = reference_steps(tok, prompt, out, stops, skip)
    final = steps[-1][1]
    detok = IncrementalDetokenizer(tok, prompt, tuple(stops), skip)
    streamed = ""
    for t, (stopped, text, safe, settled), call in zip(out, steps, calls):
        detok.add(t)
        assert detok.stopped == stopped
        if call or stopped:
            streamed += detok.stream_delta()
        assert final.startswith(streamed)  # never past a stop match
        assert not any(s in streamed for s in stops)
        if settled:
            assert detok.text == text
            if call or stopped:
                assert streamed == safe  # holds back exactly the possible stop prefix
    for t in out[len(steps):]:  # after a stop, more tokens change nothing
        detok.add(t)
    streamed += detok.stream_delta(final=True)
    assert streamed == final == detok.text
    assert detok.stopped == steps[-1][0]
    assert detok.stream_delta(final=True) == ""
    event(f"stopped: {detok.stopped}")
    event(f"held back at some step: {any(safe != text for _, text, safe, _ in steps)}")
    event(f"multi-byte chars: {any(ord(c) > 127 for c in final)}")


def test_stop_cut_at_earliest_start_across_stop_strings(tok):
    # One token brings " the": "th" completes first in it, but " the" starts earlier: cut there.
    *head, the = tok.encode("Once the", add_special_tokens=False)
    assert tok.token_text(the) == " the"
    detok = IncrementalDetokenizer(tok, [1], ("th", " the"))
    for t in head:
        detok.add(t)
    assert detok.stream_delta() == "Once" and not detok.stopped
    detok.add(the)
    assert detok.stopped and detok.text == "Once" and detok.stream_delta() == ""


def test_overlapping_stop_split_across_tokens(tok):
    [a], [b] = char_tokens("a"), char_tokens("b")
    detok = IncrementalDetokenizer(tok, [], ("aaab",))
    deltas = []
    for _ in range(5):
        detok.add(a)
        deltas.append(detok.stream_delta())
    assert deltas == ["", "", "", "a", "a"]  # "aaa" could still become "aaab"
    assert detok.text == "aaaaa" and not detok.stopped
    detok.add(b)
    assert detok.stopped and detok.text == "aa" and detok.stream_delta() == ""


# -- 2. per-call work --------------------------------------------------------------------------

N_OUT = 5000


def run_counted(tok: Tokenizer, out: list[int], stops: tuple[str, ...],
                monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Per step (add + stream_delta): decode calls, longest decode input, Python lines run in
    tokenizer.py, peak bytes allocated, and chars added to the text plus chars streamed."""
    decode = tok.decode
    calls: list[int] = []

    def counting_decode(ids, skip_special_tokens=True):
        calls.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    lines = 0
    module_file = tokenizer_module.__file__

    def trace_line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return trace_line

    def trace_call(frame, event, arg):
        return trace_line if frame.f_code.co_filename == module_file else None

    detok = IncrementalDetokenizer(tok, [1], stops)
    stats: dict[str, list] = {"decodes": [], "decode_len": [], "lines": [], "alloc": [],
                                   "chars": []}
    length = 0
    tracemalloc.start()
    try:
        for t in out:
            calls.clear()
            lines = 0
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            sys.settrace(trace_call)
            try:
                detok.add(t)
                delta = detok.stream_delta()
            finally:
                sys.settrace(None)
            stats["alloc"].append(tracemalloc.get_traced_memory()[1] - before)
            stats["lines"].append(lines)
            stats["decodes"].append(len(calls))
            stats["decode_len"].append(max(calls, default=0))
            stats["chars"].append(len(detok.text) - length + len(delta))
            length = len(detok.text)
    finally:
        tracemalloc.stop()
    assert not detok.stopped
    return stats


def test_per_call_work_is_flat_in_output_and_stop_length(tok, monkeypatch):
    ids = tok.encode(STORY, add_special_tokens=False)
    out = (ids * (N_OUT // len(ids) + 1))[:N_OUT]
    text = tok.decode([1, *out])
    assert len(text) > 12_000
    # Stops that the periodic text keeps matching up to their last char ("#" never comes), so
    # the held-back tail grows to len(stop) - 1 once per period: the old detokenizer rescanned
    # O(len(stop)^2) chars for it on every call.
    short = run_counted(tok, out, (text[100:115] + "#",), monkeypatch)
    long = run_counted(tok, out, (text[100:355] + "#",), monkeypatch)
    w = IncrementalDetokenizer.WINDOW
    for stats in (short, long):
        assert max(stats["decodes"]) <= 2
        assert max(stats["decode_len"]) <= w + 2
        # Python lines run per char added or streamed (+1 per step): releasing a held-back tail
        # costs its length once, so this, not lines per step, is what must stay bounded.
        stats["work"] = [n / (1 + c) for n, c in zip(stats["lines"], stats["chars"], strict=True)]
        # Not growing with output length: late steps cost what early ones did.
        lines, work = stats["lines"], stats["work"]
        assert statistics.mean(lines[-1000:]) <= 1.2 * statistics.mean(lines[:1000])
        assert max(work[-1000:]) <= 1.2 * max(work[:1000])
        # No per-step copy of the whole text (about 13 KB by the end): beyond the rare
        # amortized list growth, a step allocates a few hundred bytes.
        assert sum(a > 4096 for a in stats["alloc"]) <= 0.02 * N_OUT
    # Not growing with stop length: a 16 times longer stop, the same work (the old detokenizer:
    # 7 times the lines per step, 14 times the worst lines per char).
    assert statistics.mean(long["lines"]) <= 1.2 * statistics.mean(short["lines"])
    assert max(long["work"]) <= 1.2 * max(short["work"])


@pytest.mark.parametrize("token,text", [(2, ""), (1, ""), (0x80 + 3, "\ufffd")])
def test_runs_of_tokens_that_add_no_text_cost_a_bounded_decode(tok, monkeypatch, token, text):
    """A long run of skipped special tokens (EOS with ignore_eos, BOS) or of bytes that never
    complete a character must not re-decode the whole run on every token."""
    widths = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, skip=True: widths.append(len(ids)) or
                        decode(ids, skip))
    d = IncrementalDetokenizer(tok, [1, 403], ())
    for _ in range(2000):
        d.add(token)
    assert max(widths, default=0) <= d.WINDOW + d.MAX_CHAR_TOKENS + 1
    assert d.text == text * (len(d.text) // max(len(text), 1))  # invalid bytes come out as U+FFFD


@pytest.mark.parametrize("min_tokens", [1, 2, 3, 4])
def test_a_stop_string_counts_from_the_min_tokens_th_token(tok, min_tokens):
    # "xy" is completed by tokens 2 and 4: the first completion at or after token min_tokens
    # stops the output (vLLM), an earlier one is text like any other.
    [x], [y] = char_tokens("x"), char_tokens("y")
    detok = IncrementalDetokenizer(tok, [1], ("xy",), min_tokens=min_tokens)
    stopped_at = None
    for k, t in enumerate([x, y, x, y, x], start=1):
        detok.add(t)
        if detok.stopped and stopped_at is None:
            stopped_at = k
    assert stopped_at == (2 if min_tokens <= 2 else 4)
    assert detok.text == ("" if min_tokens <= 2 else "xy") and detok.matched == "xy"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(head=st.text(alphabet="a0\x80\x81é€𐀀", max_size=8),
       out=st.text(alphabet="va3_ é€𐀀\x81", min_size=1, max_size=6))
def test_output_after_a_prompt_ending_in_multibyte_characters(tok, head, out):
    # the prompt's window may start inside a character (its 5 last tokens are bytes of
    # 𐀀 and \x81): output byte tokens joined that run of invalid bytes and came out as
    # U+FFFD ("v3_x" was "\ufffd3_x", found by the grammar fuzz)
    prompt = tok.encode(head + "𐀀\x81")
    ids = tok.encode(out, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    for t in ids:
        d.add(t)
    whole = tok.decode(prompt + ids)
    assert d.text == whole[len(tok.decode(prompt)):]
