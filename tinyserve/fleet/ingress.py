"""The fleet's HTTP front: Serve's proxy hands each request to this deployment, which routes
it to a replica (tinyserve.fleet.router) and streams the replica's answer back unchanged.

A request is retried once, on another replica, when its replica fails before the client has
seen anything of the answer: the replica's server died, the connection to it broke, or it
answered 503 (draining, not ready) or 429 (its queue is full). After the first output has
gone out the stream cannot be redone elsewhere: it ends with an error event in the OpenAI
envelope and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from tinyserve.api.auth import find_tenant
from tinyserve.api.errors import ApiError
from tinyserve.fleet.relay import (
    FleetRequest,
    ReplicaDown,
    header_text,
    relay_headers,
    routing_text,
    server_tenants,
)

log = logging.getLogger("ray.serve")

RETRY_STATUSES = frozenset({429, 503})


def _error(status: int, message: str, code: str | None = None) -> Response:
    return Response(ApiError(status, message, code=code).body(), status_code=status,
                    media_type="application/json")


class FleetIngress:
    """The Serve deployment class (decorated in :mod:`tinyserve.fleet.app`)."""

    def __init__(self, replicas, max_body_bytes: int = 4 * 2**20,
                 route_timeout_s: float = 60.0, server_args: list[str] | None = None) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.route_timeout_s = route_timeout_s
        # the replicas' keys: only a known caller's prompt steers routing
        self.tenants = server_tenants(server_args or [])

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/health":  # this ingress is up; /ready asks a replica
            return Response(b'{"status":"ok"}', media_type="application/json")
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        except ValueError as e:
            return _error(413, str(e))
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        # The replica checks the key again and answers 401 itself; here an unknown caller's
        # body is simply not read, so it cannot steer which replica's cache others land on.
        key = header_text(request.headers.get("authorization", ""))
        known = find_tenant(self.tenants, key) is not None
        req = FleetRequest(request.method, path, relay_headers(request.headers.items()), body,
                           routing_text(body) if body and known else "")
        return await self._answer(req)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ValueError(f"request body of {declared} bytes is over the "
                             f"{self.max_body_bytes}-byte limit")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > self.max_body_bytes:
                raise ValueError(f"request body is over the {self.max_body_bytes}-byte limit")
        return bytes(buf)

    async def _answer(self, req: FleetRequest) -> Response:
        why = "no replica answered"
        for attempt in range(2):
            gen = self.replicas.forward.remote(req)
            replica: str | None = None
            try:
                async with asyncio.timeout(self.route_timeout_s):
                    replica = await gen.__anext__()  # routing waits here when none is up
                status, headers = await gen.__anext__()
                if status in RETRY_STATUSES and attempt == 0:
                    why = f"replica {replica} answered {status}"
                    raise _Retry(why)
                first = await _next_or_empty(gen)
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except TimeoutError:
                gen.cancel()
                return _error(503, f"no replica accepted the request within "
                                   f"{self.route_timeout_s:g}s", "no_replica")
            except Exception as e:  # the replica or its server died before any output
                gen.cancel()
                why = _reason(e)
                log.warning("attempt %d failed before its first output (%s)%s", attempt + 1,
                            e if isinstance(e, _Retry) else repr(e),
                            "; retrying on another replica" if attempt == 0 else "")
                if attempt == 0:
                    req = dataclasses.replace(
                        req, exclude=req.exclude + ((replica,) if replica else ()))
                continue
            hdrs = dict(headers)
            hdrs["x-tinyserve-replica"] = replica
            hdrs["x-tinyserve-attempts"] = str(attempt + 1)
            if not hdrs.get("content-type", "").startswith("text/event-stream"):
                gen.cancel()  # a whole body is one chunk: nothing more will come
                return Response(first, status_code=status, headers=hdrs)
            return StreamingResponse(self._rest(gen, first), status_code=status, headers=hdrs)
        return _error(502, f"the request failed on two replicas: {why}", "replica_failed")

    @staticmethod
    async def _rest(gen, first: bytes) -> AsyncIterator[bytes]:
        """The rest of an SSE stream; a failing replica's stream ends with an error event."""
        done = False
        last = first
        try:
            if first:
                yield first
            async for chunk in gen:
                last = chunk
                yield chunk
            done = True
        except Exception as e:
            log.warning("stream ended by a failing replica: %r", e)
            err = ApiError(502, "the replica serving this stream failed; the output above is "
                                "incomplete", code="replica_failed")
            # The replica sends whole events; should a partial one have slipped through, the
            # blank line ends it so the error is an event of its own.
            sep = b"" if not last or last.endswith(b"\n\n") else b"\n\n"
            yield sep + b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"
            done = True
        finally:
            if not done:
                gen.cancel()  # the client left: the replica aborts the request


class _Retry(Exception):
    pass


def _reason(e: BaseException) -> str:
    """A failure, told to the client without Ray's remote traceback."""
    cause = getattr(e, "cause", None) or e  # Ray wraps a replica's exception
    if isinstance(cause, ReplicaDown) and hasattr(cause, "why"):
        return f"replica {cause.replica_id}: {cause.why}"
    if isinstance(cause, _Retry):
        return str(cause)
    return type(cause).__name__


async def _next_or_empty(gen) -> bytes:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return b""
