"""The fleet replica's relay and child process, against stand-ins (no Ray): a server that
streams, breaks off, or answers 503 in its stream; a child that logs a huge line or dies."""

import asyncio
import sys

import aiohttp
import msgspec
import pytest
from aiohttp import web

from tinyserve.fleet.relay import FleetRequest, ReplicaDown
from tinyserve.fleet.replica import ServerProcess, TinyserveReplica


def _event(doc) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"


OPENING = _event({"choices": [{"index": 0, "delta": {"role": "assistant"},
                               "finish_reason": None}]})


def _token(t: str) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]})


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


class _AliveServer:
    alive = True


async def _relay(handler) -> tuple[list, BaseException | None]:
    """Runs TinyserveReplica.forward against ``handler``; -> (items yielded, error)."""
    runner, port = await _serve(handler)
    replica = object.__new__(TinyserveReplica)
    replica.replica_id, replica.server = "r1", _AliveServer()
    replica.base = f"http://127.0.0.1:{port}"
    replica.session = aiohttp.ClientSession()
    items, err = [], None
    try:
        async for item in replica.forward(FleetRequest("POST", "/v1/chat/completions", [], b"{}")):
            items.append(item)
    except ReplicaDown as e:
        err = e
    finally:
        await replica.session.close()
        await runner.cleanup()
    return items, err


def _sse_handler(parts, then_break: bool = False):
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in parts:
            await resp.write(p)
            await asyncio.sleep(0.02)
        if then_break:
            request.transport.abort()  # the server dies mid-stream
            return resp
        await resp.write_eof()
        return resp
    return handler


def test_opening_is_held_back_and_only_whole_events_are_relayed():
    t1, t2 = _token("Once"), _token(" upon")
    parts = [OPENING, t1[:7], t1[7:] + t2[:5], t2[5:], b"data: [DONE]\n\n"]
    items, err = asyncio.run(_relay(_sse_handler(parts)))
    assert err is None
    assert items[0] == "r1" and items[1][0] == 200
    body = items[2:]
    assert body[0] == OPENING + t1  # held until the first token, then both at once
    assert all(chunk.endswith(b"\n\n") for chunk in body)
    assert b"".join(body) == b"".join(parts)


def test_a_break_before_any_output_is_a_replica_failure():
    items, err = asyncio.run(_relay(_sse_handler([OPENING], then_break=True)))
    assert isinstance(err, ReplicaDown) and err.replica_id == "r1"
    assert len(items) == 2  # id and head only: the ingress may still retry elsewhere


def test_a_break_mid_stream_leaves_no_partial_event_behind():
    t1 = _token("Once")
    items, err = asyncio.run(_relay(_sse_handler([OPENING, t1, _token(" upon")[:9]],
                                                 then_break=True)))
    assert isinstance(err, ReplicaDown)
    assert b"".join(items[2:]) == OPENING + t1  # the half event was not passed on


def test_service_unavailable_before_any_output_is_retryable():
    err_event = _event({"error": {"message": "draining", "type": "service_unavailable",
                                  "param": None, "code": None}})
    items, err = asyncio.run(_relay(_sse_handler([OPENING, err_event, b"data: [DONE]\n\n"])))
    assert isinstance(err, ReplicaDown) and "unavailable" in str(err)
    # Any other error event is the server's answer: passed through.
    other = _event({"error": {"message": "boom", "type": "server_error", "param": None,
                              "code": None}})
    items, err = asyncio.run(_relay(_sse_handler([OPENING, other, b"data: [DONE]\n\n"])))
    assert err is None and b"boom" in b"".join(items[2:])


def test_a_whole_body_is_one_chunk():
    async def handler(request):
        return web.json_response({"id": "x"}, status=400)
    items, err = asyncio.run(_relay(handler))
    assert err is None and items[1][0] == 400 and msgspec.json.decode(items[2]) == {"id": "x"}


def test_dead_server_fails_before_anything():
    async def go():
        replica = object.__new__(TinyserveReplica)
        replica.replica_id, replica.session = "r9", None
        replica.server = ServerProcess([])
        gen = replica.forward(FleetRequest("GET", "/v1/models", [], b""))
        assert await gen.__anext__() == "r9"
        with pytest.raises(ReplicaDown):
            await gen.__anext__()
    asyncio.run(go())


def _stand_in(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_child_log_lines_of_any_length_keep_the_pipe_drained():
    code = ("import sys, time\n"
            "sys.stderr.write('x' * 300000 + '\\n'); sys.stderr.flush()\n"
            "sys.stderr.write('y' * 2000000); sys.stderr.write('\\n')\n"
            "print('INFO listening on http://127.0.0.1:4321 (not ready)', file=sys.stderr)\n"
            "sys.stderr.flush(); time.sleep(30)\n")

    async def go():
        p = ServerProcess([], command=_stand_in(code))
        await p.start(20)
        assert p.port == 4321 and p.alive
        await p.stop(5)
        assert not p.alive
    asyncio.run(go())


def test_child_that_exits_before_listening_fails_the_start():
    async def go():
        p = ServerProcess([], command=_stand_in("import sys; print('no model', file=sys.stderr)"
                                                "; sys.exit(3)"))
        with pytest.raises(RuntimeError, match="exited with 3 before listening"):
            await p.start(20)
    asyncio.run(go())


def test_child_that_never_listens_times_out_and_is_stopped():
    async def go():
        p = ServerProcess([], command=_stand_in("import time; time.sleep(60)"))
        with pytest.raises(TimeoutError):
            await p.start(0.5)
        assert not p.alive
    asyncio.run(go())


def test_host_and_port_belong_to_the_replica():
    for bad in (["--port", "8000"], ["--host=0.0.0.0"]):
        with pytest.raises(ValueError):
            ServerProcess(bad)
