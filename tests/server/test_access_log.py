"""JSON access logs (--access-log): one line per API request with its id, tenant, model,
tokens, TTFT, latency and status; nothing secret; nothing for probes; off by default."""

import asyncio
import json
import logging
import threading

import aiohttp

from tests.server.helpers import chat, completion, post, run, stream
from tests.server.inprocess import FakeRunner, InProcessServer
from tinyserve.config import TenantConfig

KEY = "sekret-key-of-acme"


def lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tinyserve.access"]


def test_every_api_request_gets_one_json_line(caplog):
    srv = InProcessServer(FakeRunner(), access_log=True,
                          tenants=(TenantConfig("acme", KEY, admin=True),))
    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-abc-1"}
    try:
        with caplog.at_level(logging.INFO, logger="tinyserve.access"):
            async def main():
                s1, _, _ = await post(srv.url, "/v1/completions", completion("Once", 5), auth)
                events, done, _ = await stream(srv.url, "/v1/chat/completions", chat("Hi", 4), auth)
                s3, _, _ = await post(srv.url, "/v1/completions", completion("x", max_tokens=-1), auth)
                s4, _, _ = await post(srv.url, "/v1/completions", completion("x"),
                                      {"Authorization": "Bearer wrong-key"})
                async with aiohttp.ClientSession() as s:
                    async with s.get(srv.url + "/v1/models", headers=auth) as r:
                        assert r.status == 200
                async with aiohttp.ClientSession() as s:
                    async with s.get(srv.url + "/health") as r:
                        assert r.status == 200
                return s1, done, s3, s4

            assert run(main()) == (200, True, 400, 401)
            srv.wait_idle()
    finally:
        srv.stop()
    got = lines(caplog)
    assert [(x["path"], x["status"]) for x in got] == [
        ("/v1/completions", 200), ("/v1/chat/completions", 200), ("/v1/completions", 400),
        ("/v1/completions", 401), ("/v1/models", 200)]  # no line for /health
    ok, streamed, bad, denied, models = got
    assert models["tenant"] == "acme"
    assert ok["request_id"] == "req-abc-1" and ok["tenant"] == "acme" and ok["model"] == "stories260k"
    assert ok["completion_tokens"] == 5 and ok["prompt_tokens"] >= 1 and ok["finish_reason"] == "length"
    assert ok["stream"] is False and streamed["stream"] is True and streamed["completion_tokens"] == 4
    for x in (ok, streamed):
        assert 0 <= x["ttft_ms"] <= x["latency_ms"] and isinstance(x["id"], int)
    assert bad["tenant"] == "acme" and bad["completion_tokens"] == 0 and bad["ttft_ms"] is None
    assert denied["tenant"] is None  # the key named no tenant
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in text and "wrong-key" not in text and "Once" not in text  # no secrets, no prompts


def test_a_stream_that_fails_after_its_200_and_a_client_that_leaves(caplog):
    runner = FakeRunner()
    srv = InProcessServer(runner, access_log=True)
    try:
        with caplog.at_level(logging.INFO, logger="tinyserve.access"):
            async def failing_stream():
                runner.fail_next = 100  # every step fails from now on
                async with aiohttp.ClientSession() as s:
                    async with s.post(srv.url + "/v1/completions",
                                      json={**completion("Once", 8), "stream": True}) as r:
                        assert r.status == 200
                        return await r.text()

            body = run(failing_stream())
            assert '"error"' in body
            runner.fail_next = 0
            hold = runner.hang = threading.Event()  # steps wait: the client gives up first

            async def vanishing_client():
                async with aiohttp.ClientSession() as s:
                    try:
                        async with asyncio.timeout(1.0):
                            async with s.post(srv.url + "/v1/completions",
                                              json=completion("Once", 8)) as r:
                                await r.text()
                    except TimeoutError:
                        pass

            run(vanishing_client())
            hold.set()
            runner.hang = None
            srv.wait_idle()
    finally:
        srv.stop()
    failed, gone = lines(caplog)[-2:]
    assert failed["status"] == 200 and failed["stream_error"] == 500 and failed["stream"] is True
    assert gone["status"] == 499 and gone["completion_tokens"] == 0


def test_off_by_default(caplog):
    srv = InProcessServer(FakeRunner())
    try:
        with caplog.at_level(logging.INFO, logger="tinyserve.access"):
            assert run(post(srv.url, "/v1/completions", completion("Once", 2)))[0] == 200
    finally:
        srv.stop()
    assert lines(caplog) == []


def test_a_line_never_raises_and_a_slow_reader_never_blocks(monkeypatch):
    import queue

    from tinyserve.api import access_log

    info = access_log.AccessInfo(started=0.0)
    access_log.write(info, "GET", "/v1/\udcff", 404, None)  # a lone surrogate: no exception
    handler = access_log._DroppingQueueHandler(queue.Queue(maxsize=2))
    for i in range(5):  # nobody drains the queue: the extra lines are dropped, not waited for
        handler.handle(logging.LogRecord("tinyserve.access", logging.INFO, "", 0, f"{i}", (), None))
    assert handler.queue.qsize() == 2 and handler.dropped == 3


def test_a_request_whose_later_choices_spill_is_logged_under_its_first_choices_model(caplog):
    """n=4 on a full model: the first choices run on it, the rest spill to the fallback; the
    access line names the model the response names (the first choice's)."""
    srv = InProcessServer(models={"a": FakeRunner(step_seconds=0.05), "b": FakeRunner()},
                          max_num_seqs=2, max_waiting=2, access_log=True,
                          fallbacks=(("a", "b"),),
                          tenants=(TenantConfig("default", degradable=True),))
    body = {"model": "a", "prompt": [1, 3], "max_tokens": 3, "n": 4, "temperature": 1}
    try:
        with caplog.at_level(logging.INFO, logger="tinyserve.access"):
            async def main():
                busy = [asyncio.ensure_future(post(srv.url, "/v1/completions", {
                    "model": "a", "prompt": [1, 2], "max_tokens": 40})) for _ in range(2)]
                await asyncio.sleep(0.2)
                got = await post(srv.url, "/v1/completions", body)
                await asyncio.gather(*busy)
                return got
            status, answer, headers = run(main())
    finally:
        srv.stop()
    assert status == 200 and headers["X-Tinyserve-Model"] == answer["model"] == "a"
    [line] = [x for x in lines(caplog) if x["completion_tokens"] == 12]
    assert line["model"] == "a"
