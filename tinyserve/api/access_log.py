"""JSON access logs (opt-in, ``--access-log``): one line per API request, once it is answered.

    {"ts": 1764500000.123, "request_id": "...", "id": 42, "method": "POST",
     "path": "/v1/chat/completions", "status": 200, "tenant": "default", "model": "m",
     "stream": true, "prompt_tokens": 12, "completion_tokens": 30, "finish_reason": "stop",
     "ttft_ms": 41.2, "latency_ms": 812.0}

``status`` is the HTTP status sent; a stream that ended with an error event after its 200
also carries ``stream_error`` (that error's status). A client that went away is 499 (nginx's
code), with whatever it had been sent. The lines go to the ``tinyserve.access`` logger, which
``configure`` points at stdout unformatted, so every line is plain JSON for a log shipper.
Probes and /metrics are not logged. Keys, prompts and outputs never are. Requests that aiohttp's
HTTP parser refuses before the app sees them (an oversized header, a bad URL) get no line.

A log reader that falls behind must not stall serving: lines go through a bounded queue to a
writer thread, and when the queue is full they are dropped (and the drops counted in the
server log, at most once a minute), never waited for.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

log = logging.getLogger("tinyserve.access")
server_log = logging.getLogger(__name__)
LOGGED_PREFIXES = ("/v1/", "/admin/", "/tokenize", "/detokenize")
CLIENT_GONE = 499
QUEUE_LINES = 10_000  # lines waiting for the writer thread before new ones are dropped


@dataclass(slots=True)
class AccessInfo:
    """What the handler learns about a request, for its access line (set as it goes)."""

    started: float  # time.monotonic() when the request arrived
    tenant: str | None = None
    model: str | None = None  # the model that answered (a fallback, if rerouted)
    id: int | None = None  # the server's own request id
    stream: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_output: float | None = None  # time.monotonic() of the first output
    stream_error: int | None = None


ACCESS = web.RequestKey("access", AccessInfo)  # on each logged request, set by the middleware


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread; a full queue drops the record instead of waiting."""

    def __init__(self, q: queue.Queue) -> None:
        super().__init__(q)
        self.dropped = 0
        self._reported = 0.0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._reported >= 60.0:
                self._reported = now
                server_log.warning("access log: stdout is not keeping up, %d lines dropped "
                                   "so far", self.dropped)


def configure() -> logging.handlers.QueueListener:
    """Access lines to stdout, bare JSON (not the server log's format), not duplicated there,
    written by a thread; returns the listener (already started)."""
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter("%(message)s"))
    q: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
    log.addHandler(_DroppingQueueHandler(q))
    log.setLevel(logging.INFO)
    log.propagate = False
    listener = logging.handlers.QueueListener(q, out)
    listener.start()
    return listener


def write(info: AccessInfo, method: str, path: str, status: int, request_id: str | None) -> None:
    """Never raises: a line that cannot be written must not replace the response."""
    try:
        log.info(_line(info, method, path, status, request_id))
    except Exception:
        server_log.exception("access log: could not write a line for %r", path)


def _line(info: AccessInfo, method: str, path: str, status: int, request_id: str | None) -> str:
    now = time.monotonic()
    # (aiohttp's pure-Python parser can hand us lone surrogates from raw path bytes)
    path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    line = {"ts": round(time.time(), 3), "request_id": request_id, "id": info.id,
            "method": method, "path": path, "status": status, "tenant": info.tenant,
            "model": info.model, "stream": info.stream, "prompt_tokens": info.prompt_tokens,
            "completion_tokens": info.completion_tokens, "finish_reason": info.finish_reason,
            "ttft_ms": None if info.first_output is None
            else round(1000 * (info.first_output - info.started), 1),
            "latency_ms": round(1000 * (now - info.started), 1)}
    if info.stream_error is not None:
        line["stream_error"] = info.stream_error
    return msgspec.json.encode(line).decode()
