"""text/stream_pieces.py: the detokenizer's lookup fast path gives exactly what its window
decode gives - every delta, every step, stop strings, held-back bytes, invalid byte runs,
special and added tokens - on stories260k (SentencePiece + byte fallback) and SmolLM2's GGUF
tokenizer (GPT-2 byte level); it is taken for plain text, and only for the decoders it knows."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import STORIES_DIR
from tinyserve.text.detokenizer import IncrementalDetokenizer
from tinyserve.text.stream_pieces import StreamPieces, _concatenative
from tinyserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer(STORIES_DIR)


@pytest.fixture(scope="module")
def smollm2(smollm2_file) -> Tokenizer:
    return Tokenizer(smollm2_file)


def _run(tok: Tokenizer, prompt, out, stops, skip, calls, fast: bool):
    """Every step's (stopped, text, streamed delta), with or without the fast path."""
    detok = IncrementalDetokenizer(tok, prompt, tuple(stops), skip)
    if not fast:
        detok._pieces_of = lambda _: None
    steps = []
    for t, call in zip(out, calls, strict=True):
        detok.add(t)
        steps.append((detok.stopped, detok.text, detok.stream_delta() if call else None))
    steps.append(detok.stream_delta(final=True))
    return steps


def _same_as_window_decode(tok: Tokenizer, data, ids) -> None:
    prompt = data.draw(st.lists(ids, max_size=6))
    out = data.draw(st.lists(ids, min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    text = tok.decode(out, skip)
    stops = data.draw(st.lists(st.one_of(
        st.sampled_from(["a", " ", "e", "the", "\n"]),
        st.integers(0, max(len(text) - 1, 0)).map(lambda i: text[i:i + 3])),
        max_size=3).map(lambda s: [x for x in s if x]))
    calls = data.draw(st.lists(st.booleans(), min_size=len(out), max_size=len(out)))
    assert _run(tok, prompt, out, stops, skip, calls, True) == \
        _run(tok, prompt, out, stops, skip, calls, False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stories260k_fast_path_is_the_window_decode(stories, data):
    ids = st.one_of(st.integers(259, 511),  # merged pieces
                    st.integers(0, 2),  # <unk> <s> </s>
                    st.integers(3, 258),  # any byte: whole characters, partial and invalid runs
                    st.sampled_from([3 + ord("a"), 3 + 10, 3 + 0xC3, 3 + 0xA9]))
    _same_as_window_decode(stories, data, ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_smollm2_fast_path_is_the_window_decode(smollm2, data):
    vocab = smollm2._tok.get_vocab_size()
    ids = st.one_of(st.integers(0, vocab - 1),  # anything: partial UTF-8 pieces too
                    st.integers(0, 16),  # the added/special tokens at the vocabulary's start
                    st.sampled_from(smollm2.encode("Hello, wörld! 日本語 😀 x²", False)))
    _same_as_window_decode(smollm2, data, ids)


@pytest.mark.parametrize("which", ["stories", "smollm2"])
def test_plain_text_takes_the_fast_path(request, which, monkeypatch):
    tok = request.getfixturevalue(which)
    assert tok.stream_pieces.enabled
    decodes = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, skip=True: decodes.append(1) or real(ids, skip))
    out = tok.encode("Once upon a time there was a little girl who loved the park", False)
    detok = IncrementalDetokenizer(tok, [out[0]], ())
    for t in out[1:]:
        detok.add(t)
    assert detok.text == real(out, True)[len(real([out[0]], True)):]
    assert len(decodes) <= 2, len(decodes)  # (the prompt's window, at most)


def test_only_known_decoders_are_trusted():
    sentencepiece = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    assert _concatenative(sentencepiece)
    assert _concatenative({"type": "ByteLevel"}) and _concatenative({"type": "Metaspace"})
    for other in ({"type": "WordPiece", "prefix": "##", "cleanup": True},
                  {"type": "CTC"}, {"type": "BPEDecoder", "suffix": "</w>"}, None,
                  {"type": "Sequence", "decoders": [{"type": "CTC"}]},
                  {"type": "Sequence", "decoders": [
                      {"type": "Replace", "pattern": {"String": "_"}, "content": " "}]},
                  {"type": "Sequence", "decoders": [
                      {"type": "Strip", "content": " ", "start": 0, "stop": 1}]}):
        assert not _concatenative(other), other


def test_an_unknown_decoder_keeps_the_window_decode():
    """A WordPiece decoder (its cleanup looks across tokens): no fast path at all."""
    from tokenizers import decoders

    tok = Tokenizer(STORIES_DIR)
    tok._tok.decoder = decoders.WordPiece()
    assert not StreamPieces(tok._tok).enabled
