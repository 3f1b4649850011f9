"""api/sse.py's Events: a text-only Output through its choice's template is byte for byte the
shaper's own chunk, for completions and chat, any text (quotes, escapes, control characters,
non-BMP), any choice, beside Outputs that must take the full path (first, logprobs, ids,
finish, tools, continuous usage) - and those are unchanged."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.api.openai.chat import ChatShaper
from tinyserve.api.openai.completion import CompletionShaper
from tinyserve.api.openai.requests import ChatCompletionRequest, CompletionRequest
from tinyserve.api.sse import Events, encode
from tinyserve.messages import Output, TokenInfo
from tinyserve.models import STORIES260K
from tinyserve.text.tokenizer import Tokenizer

TOK = Tokenizer(STORIES260K)
BASE = {"model": "stories260k", "max_tokens": 50, "stream": True}
OPTIONS = [{}, {"n": 2}, {"logprobs": 2}, {"return_token_ids": True},
           {"stream_options": {"include_usage": True}},
           {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
           {"echo": True}]


def _shaper(kind: str, extra: dict):
    n = extra.get("n", 1)
    if kind == "completion":
        req = msgspec.convert({**BASE, "prompt": [1, 5], **extra}, CompletionRequest)
        echo = [("x", [1, 5])] if extra.get("echo") else None
        return CompletionShaper(req, "stories260k", TOK, bool(extra.get("logprobs")),
                                choices=n, prompts=[[1, 5]], echo=echo)
    extra = {k: v for k, v in extra.items() if k != "echo"}
    if "logprobs" in extra:
        extra = {"logprobs": True, "top_logprobs": 2}
    req = msgspec.convert({**BASE, "messages": [{"role": "user", "content": "hi"}], **extra},
                          ChatCompletionRequest)
    return ChatShaper(req, "stories260k", TOK, bool(extra.get("logprobs")), choices=n,
                      prompts=[[1, 5]])


outputs = st.lists(st.tuples(
    st.text(min_size=0, max_size=12),
    st.booleans(),  # with a logprob entry / token id
), min_size=1, max_size=30)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("extra", OPTIONS, ids=lambda e: ",".join(e) or "plain")
@settings(max_examples=40, deadline=None)
@given(outs=outputs, split=st.integers(1, 5))
def test_events_are_the_shapers_chunks_byte_for_byte(kind, extra, outs, split):
    fast, full = _shaper(kind, extra), _shaper(kind, extra)
    full.id, full.created = fast.id, fast.created
    choices = extra.get("n", 1)
    batch, made = [], 0
    for k, (text, extra_token) in enumerate(outs):
        last = k == len(outs) - 1
        tokens = (TokenInfo(300, -0.5, ((300, -0.5),)),) if extra_token else ()
        ids = (300,) if extra_token else ()
        for i in range(choices):
            made += 1
            batch.append((i, Output(text, tokens, 1, "length" if last else None, 2, k + 1,
                                    0, token_ids=ids)))
    events = Events(fast)
    got, want = [], []
    for start in range(0, len(batch), split):  # in batches, as the reader takes them
        part = batch[start:start + split]
        got.append(events(part))
        want.append(encode([c for i, o in part for c in full.chunks(o, i)]))
    assert got == want


def test_plain_outputs_take_the_template():
    shaper = _shaper("chat", {})
    events = Events(shaper)
    calls = []
    real = shaper.chunks
    shaper.chunks = lambda out, i=0: calls.append(out.text) or real(out, i)
    data = events([(0, Output(f'w"{k}\\', (), 1)) for k in range(50)])
    assert data.count(b"data: ") == 50
    assert calls == [Events.SENTINEL]  # the template, made once; no chunk built per token
