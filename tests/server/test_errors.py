"""Bad input gets its status code and the OpenAI error envelope; the server keeps serving.
Auth, queue-full back-pressure and SIGTERM draining on dedicated servers."""

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.server.conftest import get
from tests.server.helpers import MODEL, chat, completion, post, run


def assert_envelope(status, body, want_status, param=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", completion("x", temperature=-1), 400, "temperature"),
    ("/v1/completions", completion("x", top_p=0), 400, "top_p"),
    ("/v1/completions", completion("x", n=65), 400, "n"),
    ("/v1/completions", completion([1, 5000]), 400, "prompt"),
    ("/v1/completions", completion(""), 400, "prompt"),
    ("/v1/chat/completions", chat("x", logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/completions", {**completion("x"), "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests(server, path, body, status, param):
    got_status, got, headers = run(post(server.url, path, body, raw=isinstance(body, bytes)))
    assert_envelope(got_status, got, status, param)
    assert headers["X-Request-Id"]


def test_context_overflow_names_both_numbers(server):
    status, body, _ = run(post(server.url, "/v1/completions",
                               completion([1] * 500, max_tokens=100)))
    assert_envelope(status, body, 400, "max_tokens")
    assert "512" in body["error"]["message"] and "600" in body["error"]["message"]
    assert "500" in body["error"]["message"] and "100" in body["error"]["message"]


def test_prompt_alone_beyond_the_context(server):
    status, body, _ = run(post(server.url, "/v1/completions", completion([1] * 512, max_tokens=1)))
    assert_envelope(status, body, 400, "prompt")
    assert "512" in body["error"]["message"]


def test_unknown_route_uses_the_envelope(server):
    status, body, _ = run(post(server.url, "/v1/embeddings", {"model": MODEL}))
    assert_envelope(status, body, 404)


def test_server_still_serves_after_bad_input(server):
    status, body, _ = run(post(server.url, "/v1/completions", completion("Once", 2)))
    assert status == 200 and body["choices"][0]["text"]
    assert server.metric("tinyserve:request_errors_total", '{code="400"}') >= 8


@pytest.fixture(scope="module")
def guarded(launch):
    """API key, one running request at most, no waiting room: 401 and 429 are reachable."""
    return launch("--api-key", "sekret", "--max-num-seqs", "1", "--max-waiting", "0",
                  "--drain-timeout", "60")


KEY = {"Authorization": "Bearer sekret"}


def test_api_key_is_required(guarded):
    status, body, _ = run(post(guarded.url, "/v1/completions", completion("Hi", 1)))
    assert_envelope(status, body, 401)
    status, body, _ = run(post(guarded.url, "/v1/completions", completion("Hi", 1),
                               headers={"Authorization": "Bearer wrong"}))
    assert_envelope(status, body, 401)
    status, body, _ = run(post(guarded.url, "/v1/completions", completion("Hi", 1), headers=KEY))
    assert status == 200
    assert get(guarded.url + "/health")[0] == 200  # probes need no key


async def _second_request_while_first_runs(url):
    async with aiohttp.ClientSession(headers=KEY) as s:
        first = asyncio.ensure_future(s.post(url + "/v1/completions",
                                             json=completion("Once upon", max_tokens=30)))
        await asyncio.sleep(1.0)
        async with s.post(url + "/v1/completions", json=completion("Hi", 1)) as r:
            second = (r.status, await r.json(), r.headers.get("Retry-After"))
        resp = await first
        return resp.status, second


def test_full_queue_is_answered_429_with_retry_after(guarded):
    first_status, (status, body, retry_after) = run(_second_request_while_first_runs(guarded.url))
    assert first_status == 200
    assert_envelope(status, body, 429)
    assert retry_after is not None and int(retry_after) >= 1


async def _stream_through_sigterm(srv):
    async with aiohttp.ClientSession(headers=KEY) as s:
        async with s.post(srv.url + "/v1/completions",
                          json=completion("Once upon a time", max_tokens=12, stream=True)) as r:
            chunks, done = [], False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    chunks.append(line)
                    if len(chunks) == 2:
                        srv.proc.send_signal(signal.SIGTERM)
                        await asyncio.sleep(0.3)
                        async with s.get(srv.url + "/ready") as ready:
                            ready_status = ready.status
                        async with s.post(srv.url + "/v1/completions",
                                          json=completion("Hi", 1)) as late:
                            late_status = late.status
            return len(chunks), done, ready_status, late_status


def test_sigterm_drains_running_requests_then_exits_0(guarded):
    n_chunks, done, ready_status, late_status = run(_stream_through_sigterm(guarded))
    assert done and n_chunks >= 3  # the running stream finished
    assert ready_status == 503 and late_status == 503
    deadline = time.monotonic() + 30
    while guarded.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert guarded.proc.returncode == 0, guarded.log()
