"""n > 1 on the in-process server (fake model): later choices wait in the batcher for the
first one's first token, and nothing is left behind when a client leaves or a step fails."""

import asyncio
import threading

import aiohttp

from tests.server.helpers import completion, post, run
from tests.server.inprocess import FakeRunner, InProcessServer


def held(srv: InProcessServer) -> int:
    async def read():
        return sum(len(w) for b in srv.server.batchers.values() for w in b._after.values())
    return srv.call(read())


def test_later_choices_start_after_the_first_and_share_its_prompt():
    srv = InProcessServer(FakeRunner(step_seconds=0.01))
    try:
        prompt = list(range(300, 340))  # 40 tokens: two full blocks to share
        status, body, _ = run(post(srv.url, "/v1/completions",
                                   completion(prompt, max_tokens=4, n=3, temperature=1.0,
                                              seed=5)))
        assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2], body
        assert body["usage"]["prompt_tokens"] == 40
        cores = [b.core for b in srv.server.batchers.values()]
        assert sum(c.kv.prefix_hits for c in cores) >= 2 * 32  # both later choices hit
        assert held(srv) == 0 and not any(srv.wait_idle().values())
    finally:
        srv.stop()


def test_a_client_leaving_while_choices_wait_leaves_nothing_behind():
    gate = threading.Event()
    srv = InProcessServer(FakeRunner())
    srv.runner.hang = gate  # (after the warm-up) no step ends: no first token, ever
    try:
        async def leave_early():
            async with aiohttp.ClientSession() as s:
                async with s.post(srv.url + "/v1/completions", json={
                        **completion("Once upon a time", max_tokens=4, n=4), "stream": True}) as r:
                    assert r.status == 200  # all four admitted; then the client is gone
                    await asyncio.sleep(0.3)
                    assert held(srv) == 3  # the later choices wait for the first's token
        run(leave_early())
        for _ in range(100):
            if held(srv) == 0:
                break
            threading.Event().wait(0.05)
        assert held(srv) == 0  # the waiting choices were aborted, not started later
        gate.set()  # the wedged step returns
        assert not any(srv.wait_idle().values())
        status, body, _ = run(post(srv.url, "/v1/completions", completion("Once", max_tokens=2)))
        assert status == 200, body
    finally:
        gate.set()
        srv.stop()


def test_a_failing_first_choice_fails_the_request_and_frees_the_rest():
    srv = InProcessServer(FakeRunner())
    srv.runner.fail_next = 1  # (after the warm-up) the first choice's prefill fails
    try:
        status, body, _ = run(post(srv.url, "/v1/completions",
                                   completion("Once upon a time", max_tokens=4, n=3)))
        assert status == 500, body
        assert held(srv) == 0 and not any(srv.wait_idle().values())
    finally:
        srv.stop()
