"""The ingress's stream tail and error reporting, without a cluster."""

# ruff: noqa: E402 (imports below the skip: without the ray extra, collecting is skipping)
import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.ray  # a step of its own in .ci/run

import asyncio
import json

from ray.exceptions import RayTaskError
from starlette.requests import Request
from starlette.responses import Response

from tinyserve.fleet.ingress import FleetIngress, _reason
from tinyserve.fleet.relay import ReplicaDown


class _Gen:
    """Stands in for a DeploymentResponseGenerator."""

    def __init__(self, chunks, fail: bool):
        self.chunks, self.fail, self.cancelled = list(chunks), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.chunks:
            return self.chunks.pop(0)
        if self.fail:
            raise ReplicaDown("r1", "ServerDisconnectedError: gone")
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


async def _collect(gen, first):
    return [c async for c in FleetIngress._rest(gen, first)]


def test_a_failing_stream_ends_with_its_own_error_event_and_done():
    gen = _Gen([b'data: {"choices":[{"text":" dog"}]}\n\n', b'data: {"choi'], fail=True)
    out = b"".join(asyncio.run(_collect(gen, b'data: {"choices":[{"text":"A"}]}\n\n')))
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert events[-2].startswith(b'data: {"error"') and b"replica_failed" in events[-2]
    assert not gen.cancelled  # it ended by itself


def test_a_finished_stream_is_not_cancelled_and_a_left_one_is():
    gen = _Gen([b"data: [DONE]\n\n"], fail=False)
    assert b"".join(asyncio.run(_collect(gen, b"x\n\n"))) == b"x\n\ndata: [DONE]\n\n"
    assert not gen.cancelled

    async def leave():
        g = _Gen([b"a\n\n", b"b\n\n"], fail=False)
        it = FleetIngress._rest(g, b"first\n\n")
        await it.__anext__()
        await it.aclose()  # what Starlette does when the client goes away
        return g
    assert asyncio.run(leave()).cancelled


def test_reason_never_carries_a_remote_traceback():
    try:
        raise ReplicaDown("abc", "its server process has exited")
    except ReplicaDown as c:
        wrapped = RayTaskError("forward", "Traceback (most recent call last):\n  File ...",
                               c).as_instanceof_cause()
    assert _reason(wrapped) == "replica abc: its server process has exited"
    assert _reason(RuntimeError("secret /path")) == "RuntimeError"


def _request(headers: list[tuple[str, str]], body: bytes) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode("utf-8")) for k, v in headers]}
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": body, "more_body": False}
    return Request(scope, receive)


class _Replicas:
    def options(self, **kw):
        return self


def test_an_unknown_callers_prompt_never_steers_routing():
    """The prefix tree learns prompts from the bodies it routes: only a caller whose key the
    replicas accept may feed it (the request is still relayed: the replica answers 401)."""
    ingress = FleetIngress(_Replicas(), server_args=["--api-key", "clé-a"])
    seen = []

    async def answer(req):
        seen.append(req)
        return Response(b"")

    ingress._answer = answer
    body = json.dumps({"model": "m", "prompt": "Once upon a time"}).encode()
    for key in (None, "wrong", "clé-a"):  # (a key with non-ASCII bytes: as the replica reads it)
        headers = [] if key is None else [("Authorization", f"Bearer {key}")]
        asyncio.run(ingress(_request(headers, body)))
    # (the routing key is the model, then the prompt: an adapter's prefixes are its own)
    assert [r.prompt for r in seen] == ["", "", "m\0Once upon a time"]
    assert all(r.body == body for r in seen)
    keyless = FleetIngress(_Replicas())  # no keys configured: everyone is the one tenant
    keyless._answer = answer
    asyncio.run(keyless(_request([], body)))
    assert seen[-1].prompt == "m\0Once upon a time"
