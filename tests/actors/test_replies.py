"""actors/replies.py: which Outputs a step's requests get and when they are handed over. With a
write rate, Outputs past the bucket wait on their request (longest waiting first out), a
request's first and last Output never wait, and nothing is lost, reordered or merged."""

import asyncio

import pytest

from tinyserve.actors.replies import Replies
from tinyserve.core.engine_core import CoreConfig, EngineCore
from tinyserve.core.sequence import SeqStatus
from tinyserve.messages import Failed, Output, SamplingParams
from tinyserve.models import STORIES260K
from tinyserve.text.tokenizer import Tokenizer

WORDS = list(range(259, 300))  # stories260k pieces that are whole words


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(STORIES260K)


def _core(tokenizer) -> EngineCore:
    return EngineCore(CoreConfig(num_kv_blocks=64, block_size=16, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=128, vocab_size=512,
                                 eos_token_ids=frozenset({2})), tokenizer)


QUEUES: dict[int, asyncio.Queue] = {}  # each request's reply queue, by request id


def _request(core: EngineCore, replies: Replies, rid: int, max_tokens: int = 20, **params):
    """A request joins: its reply side opens on a queue of its own (as the batcher opens it)."""
    req = core.add_request(rid, [1, 5], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                       **params))
    QUEUES[rid] = asyncio.Queue()
    replies.open(rid, QUEUES[rid])
    return req


def _token(req, tok: int, last: bool = False) -> None:
    """A step gave ``req`` the token ``tok`` (``last``: and it finished by length)."""
    req.seq.token_ids.append(tok)
    req.detok.add(tok)
    if last:
        req.seq.status, req.seq.finish_reason = SeqStatus.FINISHED, "length"


def _drain(req) -> list:
    out, queue = [], QUEUES[req.request_id]
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def test_without_a_rate_every_output_goes_out_with_its_step(tokenizer):
    core, replies = _core(tokenizer), Replies()
    req = _request(core, replies, 1)
    for i, tok in enumerate(WORDS[:5]):
        _token(req, tok, last=i == 4)
        replies.refill(float(i))
        replies.advanced(req)
        replies.stepped()
        got = _drain(req)
        assert [o.num_new_tokens for o in got] == [1]
    assert got[0].finish_reason == "length"


def test_past_the_rate_outputs_wait_and_leave_in_order_one_per_token(tokenizer):
    core = _core(tokenizer)
    replies = Replies(write_rate=100.0)  # bucket: 2 hand-offs (20 ms' worth), 1 per 10 ms
    reqs = [_request(core, replies, i) for i in range(4)]

    def step(k: int, now: float) -> None:
        replies.refill(now)
        for r in reqs:
            _token(r, WORDS[k])
            replies.advanced(r)
        replies.stepped()

    step(0, 0.001)  # first tokens: never held, whatever the budget
    assert [len(_drain(r)) for r in reqs] == [1, 1, 1, 1]
    # the bucket is spent (the first Outputs took 4 of the 2 it held): a 1 ms step hands
    # nothing over, every Output waits
    step(1, 0.002)
    assert [len(_drain(r)) for r in reqs] == [0, 0, 0, 0]
    assert all(replies.waiting(r) == 1 for r in reqs)
    # 1 ms, then 38 ms later: the bucket is back to 2, two hand-offs, the longest waiting
    # first
    step(2, 0.003)
    step(3, 0.0415)
    got = [_drain(r) for r in reqs]
    assert [len(g) for g in got] == [3, 3, 0, 0]  # each hand-off: all that waited, unmerged
    assert all(o.num_new_tokens == 1 for g in got for o in g)
    assert [o.completion_tokens for o in got[0]] == [2, 3, 4]
    # the next refill goes to the two that still wait (oldest first), not to 0 and 1 again
    replies.refill(0.065)
    replies.stepped()
    assert [len(_drain(r)) for r in reqs] == [0, 0, 3, 3]


def test_a_last_output_is_never_held_and_goes_out_behind_what_waited(tokenizer):
    core = _core(tokenizer)
    replies = Replies(write_rate=1.0)  # one hand-off a second: everything else waits
    req = _request(core, replies, 1)
    texts = []
    for i, tok in enumerate(WORDS[:6]):
        _token(req, tok, last=i == 5)
        replies.refill(0.001 * (i + 1))
        replies.advanced(req)
        replies.stepped()
        texts += [o.text for o in _drain(req)]
    assert len(texts) == 6 and replies.waiting(req) == 0
    assert "".join(texts) == req.detok.text


def test_a_failure_or_an_end_flushes_what_waited_first(tokenizer):
    core = _core(tokenizer)
    replies = Replies(write_rate=1.0)
    a, b = _request(core, replies, 1), _request(core, replies, 2)
    for r in (a, b):
        for tok in WORDS[:4]:
            _token(r, tok)
            replies.advanced(r)
    replies.send(a, Failed(500, "boom"))
    got = _drain(a)
    assert [type(m) for m in got] == [Output] * 4 + [Failed]
    assert replies.waiting(b) == 3  # (its first Output went out at once)
    replies.close(b)  # (as the batcher forgets a request)
    assert len(_drain(b)) == 4 and replies.waiting(b) == 0
    replies.refill(10.0)
    replies.stepped()  # nothing left waiting: nothing is sent twice
    assert _drain(a) == [] and _drain(b) == []


def test_the_stream_interval_still_merges_tokens_into_one_output(tokenizer):
    core = _core(tokenizer)
    replies = Replies(stream_interval=3, write_rate=1.0)
    req = _request(core, replies, 1)
    for i, tok in enumerate(WORDS[:8]):
        _token(req, tok, last=i == 7)
        replies.advanced(req)
    assert [o.num_new_tokens for o in _drain(req)] == [1, 3, 3, 1]


def test_the_bucket_fills_with_time_and_holds_at_most_its_burst(tokenizer):
    """Steps 1 ms apart earn 1 hand-off each at 1,000/s and Outputs wait; after an idle
    second the bucket holds 20 (BURST_S), not 1,000: one burst, then waiting again."""
    core = _core(tokenizer)
    replies = Replies(write_rate=1000.0)
    reqs = [_request(core, replies, i) for i in range(8)]
    now = 0.0
    for k in range(12):
        now += 1.0 if k == 6 else 0.001
        replies.refill(now)
        for r in reqs:
            _token(r, WORDS[k])
            replies.advanced(r)
        replies.stepped()
        if k in (5, 11):
            assert any(replies.waiting(r) for r in reqs)
    for r in reqs:
        replies.close(r)
        assert [o.completion_tokens for o in _drain(r)] == list(range(1, 13))


def test_every_stream_waits_its_turn_whatever_its_place_in_the_step(tokenizer):
    """100 streams, 50 hand-offs a step, the same order every step: each stream is handed
    its Outputs every second or third step - none is served each step while the ones at
    the back of the step wait to their end (their Outputs would all go out with the last)."""
    core = EngineCore(CoreConfig(num_kv_blocks=2048, block_size=16, max_num_seqs=128,
                                 max_num_batched_tokens=4096, max_model_len=128,
                                 vocab_size=512, eos_token_ids=frozenset({2})), tokenizer)
    replies = Replies(write_rate=5000.0)  # 50 per 10 ms step
    reqs = [_request(core, replies, i, max_tokens=40) for i in range(100)]
    longest = [0] * 100
    for k in range(30):
        replies.refill(0.010 * (k + 1))
        for r in reqs:
            _token(r, WORDS[k % len(WORDS)])
            replies.advanced(r)
        replies.stepped()
        for i, r in enumerate(reqs):
            longest[i] = max(longest[i], replies.waiting(r))
            _drain(r)
    assert max(longest) <= 3, sorted(longest)[-5:]


def test_the_first_text_is_never_held_even_after_a_token_that_showed_none(tokenizer):
    """A first token that shows nothing yet (here: "\\n" that may start the stop string
    "\\n\\n"), then text: that text is the reader's first and goes out at once."""
    core = _core(tokenizer)
    replies = Replies(write_rate=1.0)
    req = _request(core, replies, 1, stop=("\n\n",))
    newline = tokenizer.encode("a\n", add_special_tokens=False)[-1]
    replies.refill(0.0)
    other = _request(core, replies, 2)
    _token(other, WORDS[1])
    replies.advanced(other)  # its first Output: out at once, and the bucket is empty
    assert len(_drain(other)) == 1
    for tok in (newline, WORDS[0]):
        _token(req, tok)
        replies.advanced(req)
    got = _drain(req)
    assert [o.text for o in got] == ["\n" + tokenizer.decode([1, 5, newline, WORDS[0]])[
        len(tokenizer.decode([1, 5, newline])):]] and replies.waiting(req) == 0
