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
