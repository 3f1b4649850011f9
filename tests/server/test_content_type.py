"""Only JSON bodies are read: a POST whose Content-Type is not JSON gets 415 and runs nothing.

The hole it closes: a browser sends ``text/plain``, form-encoded and multipart bodies to
another origin without a CORS preflight, so any web page a user visits could otherwise make a
keyless server on localhost run requests (admin routes included) by posting JSON as plain
text; the page never sees the answer, but the work is done.
"""

import asyncio
import json

import aiohttp
import pytest

from tests.server.inprocess import FakeRunner, InProcessServer
from tinyserve.api.app import Api
from tinyserve.config import ServerConfig

# One body per POST route that would succeed as JSON (the control below proves it).
BODIES = {
    "/v1/completions": {"model": "a", "prompt": "Once", "max_tokens": 2},
    "/v1/chat/completions": {"model": "a", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/v1/responses": {"model": "a", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "a", "max_tokens": 2, "messages": [{"role": "user",
                                                                 "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "a", "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": "a", "prompt": "Once"},
    "/detokenize": {"model": "a", "tokens": [300, 301]},
    "/admin/routes": {"alias": "chat", "weights": {"a": 10, "b": 90}},
    "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nowhere"},
    "/v1/unload_lora_adapter": {"lora_name": "x"},
}
# Read and answered on their merits on this server, which serves no adapters
JSON_ANSWERS = {"/v1/load_lora_adapter": 400, "/v1/unload_lora_adapter": 404}
NOT_JSON = [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/octet-stream", "text/json"]


def test_every_post_route_is_covered():
    app = Api(ServerConfig()).app()
    posts = {r.resource.canonical for r in app.router.routes() if r.method == "POST"}
    assert posts == set(BODIES)


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer(models={"a": FakeRunner(), "b": FakeRunner()},
                             routes=(("chat", (("a", 50.0), ("b", 50.0))),))
    yield server
    server.stop()


async def _post(url: str, path: str, content_type: str | None) -> tuple[int, dict]:
    headers = {"Origin": "http://evil.example"}  # what a cross-site page's request carries
    if content_type is not None:
        headers["Content-Type"] = content_type
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as s:
        async with s.post(url + path, data=json.dumps(BODIES[path]).encode(),
                          headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def _table(srv: InProcessServer) -> dict:
    return srv.server.router.table()


def _state(srv: InProcessServer) -> tuple:
    """What running any of the routes would change: steps run, the route table."""
    return sum(r.steps for r in srv.runners.values()), repr(srv.call(_table(srv)))


def test_a_non_json_post_is_refused_before_anything_runs(srv):
    before = _state(srv)
    for path in BODIES:
        for kind in NOT_JSON:
            status, body = asyncio.run(_post(srv.url, path, kind))
            assert status == 415, (path, kind, status, body)
            assert body["error"]["type"] == "invalid_request_error"
            if path.startswith("/v1/messages"):  # Anthropic's envelope: no code
                assert body["type"] == "error" and "Content-Type" in body["error"]["message"]
            else:
                assert body["error"]["code"] == "unsupported_media_type", body
    assert _state(srv) == before  # no step ran, no route changed
    assert srv.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "requests": 0,
                               "live": 0}


def test_the_same_bodies_as_json_are_served(srv):
    for path in BODIES:
        for kind in ("application/json", "application/json; charset=utf-8"):
            status, body = asyncio.run(_post(srv.url, path, kind))
            assert status == JSON_ANSWERS.get(path, 200), (path, kind, status, body)
    assert srv.call(_table(srv))["chat"] == {"a": 10.0, "b": 90.0}  # the admin POST ran
