"""--stream-interval (vLLM's): a stream's tokens go out every N tokens, the first and the last
at once; the text, the token ids and the whole answers are the same as with N = 1."""

import pytest

from tests.server.helpers import completion, post, run, stream
from tests.server.inprocess import FakeRunner, InProcessServer
from tinyserve.config import ServerConfig


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stream_sends_every_n_tokens_and_the_same_text(interval):
    srv = InProcessServer(FakeRunner(), stream_interval=interval)
    try:
        body = completion([1, 300], max_tokens=10, ignore_eos=True, return_token_ids=True)
        events, done, _ = run(stream(srv.url, "/v1/completions", body))
        assert done
        chunks = [c for e in events for c in e.get("choices", ())]
        sizes = [len(c.get("token_ids") or ()) for c in chunks]
        # the first token alone (time to first token is not held back), then N at a time,
        # the rest with the finish
        want = [1, 4, 4, 1] if interval == 4 else [1] * 10
        assert [s for s in sizes if s] == want, sizes
        status, whole, _ = run(post(srv.url, "/v1/completions", body))
        assert status == 200
        assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
        assert sum((c.get("token_ids") or [] for c in chunks), []) == \
            whole["choices"][0]["token_ids"]
    finally:
        srv.stop()


def test_the_interval_is_validated():
    with pytest.raises(ValueError, match="stream_interval"):
        ServerConfig(stream_interval=0)


def test_past_the_write_rate_streams_get_every_token_as_its_own_event_in_fewer_writes(
        monkeypatch):
    """--stream-write-rate: 16 streams at a step every 2 ms want ~8,000 hand-offs a second;
    at 500 their tokens wait and go out several a write, each still its own SSE event, and
    the answers are those of an unlimited server."""
    import asyncio

    import tinyserve.api.sse as sse

    writes = []
    real = sse._sender

    def counting(resp, transport):
        send = real(resp, transport)

        async def counted(data):
            writes.append(data.count(b"data: "))  # the events this write carries
            await send(data)
        return counted

    monkeypatch.setattr(sse, "_sender", counting)

    async def streams(url):
        return await asyncio.gather(*(stream(url, "/v1/completions", completion(
            [1, 300 + i], max_tokens=24, ignore_eos=True, return_token_ids=True))
            for i in range(16)))

    answers = {}
    for rate in (0.0, 500.0):
        writes.clear()
        srv = InProcessServer(FakeRunner(step_seconds=0.002), stream_write_rate=rate)
        try:
            got = run(streams(srv.url))
        finally:
            srv.stop()
        answers[rate] = []
        for events, done, _ in got:
            assert done
            chunks = [c for e in events for c in e.get("choices", ())]
            assert [len(c.get("token_ids") or ()) for c in chunks if c.get("token_ids")] \
                == [1] * 24  # one event per token
            answers[rate].append(("".join(c["text"] for c in chunks),
                                  sum((c["token_ids"] for c in chunks if c.get("token_ids")),
                                      [])))
        events_written = sum(writes)
        if rate:  # several events a write (the first and last events are never held)
            assert len(writes) < events_written * 0.6, (len(writes), events_written)
    assert answers[0.0] == answers[500.0]


def test_the_write_rate_is_validated():
    with pytest.raises(ValueError, match="stream_write_rate"):
        ServerConfig(stream_write_rate=-1)


def test_held_outputs_compose_with_choices_logprobs_stop_strings_and_leaving_clients():
    """A write rate of 50/s holds nearly everything: n=2 with logprobs and a stop string gets
    the unlimited server's answer, event for event; clients that leave mid-stream while their
    tokens wait free every block and slot; the server is idle after."""
    import asyncio

    import aiohttp

    from tests.server.inprocess import next_token

    # the 11th and 12th tokens' text as the stop string: it ends the choices while their
    # tokens wait
    toks, last = [], 300
    for pos in range(2, 14):
        last = next_token(last, pos)
        toks.append(last)
    from tinyserve.models import STORIES260K
    from tinyserve.text.tokenizer import Tokenizer
    stop = Tokenizer(STORIES260K).decode(toks[10:12])
    body = completion([1, 300], max_tokens=40, ignore_eos=True, n=2, logprobs=2, stop=[stop])

    async def leaving(url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=completion(
                    [1, 400], max_tokens=100, ignore_eos=True, stream=True)) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        return  # leaves after its first event, the rest held or unsent

    answers = []
    for rate in (0.0, 50.0):
        srv = InProcessServer(FakeRunner(step_seconds=0.002), stream_write_rate=rate)
        try:
            async def main(url):
                got = await asyncio.gather(stream(url, "/v1/completions", body),
                                           *(leaving(url) for _ in range(6)))
                return got[0]
            events, done, _ = run(main(srv.url))
            assert done
            answers.append([[(c["index"], c["text"], c["finish_reason"],
                              c["logprobs"]["tokens"] if c.get("logprobs") else None)
                             for c in e.get("choices", ())] for e in events])
            assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0,
                                       "requests": 0, "live": 0}
        finally:
            srv.stop()
    # each choice's events alike (how the two choices interleave is timing)
    per_choice = [{i: [c for e in a for c in e if c[0] == i] for i in (0, 1)} for a in answers]
    assert per_choice[0] == per_choice[1]
    for i in (0, 1):
        events = per_choice[1][i]
        assert events[-1][2] == "stop" and len(events) > 5
        assert stop not in "".join(c[1] for c in events)
