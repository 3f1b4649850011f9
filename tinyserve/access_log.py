"""JSON access logs (opt-in, ``--access-log``): one line per API request, once it is answered.

    {"ts": 1764500000.123, "request_id": "...", "id": 42, "method": "POST",
     "path": "/v1/chat/completions", "status": 200, "tenant": "default", "model": "m",
     "stream": true, "prompt_tokens": 12, "completion_tokens": 30, "finish_reason": "stop",
     "ttft_ms": 41.2, "latency_ms": 812.0}

``status`` is the HTTP status sent; a stream that ended with an error event after its 200
also carries ``stream_error`` (that error's status). A client that went away is 499 (nginx's
code), with whatever it had been sent. The lines go to the ``tinyserve.access`` logger, which
``configure`` points at stdout unformatted, so every line is plain JSON for a log shipper.
Probes and /metrics are not logged. Keys, prompts and outputs never are.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import msgspec

log = logging.getLogger("tinyserve.access")
LOGGED_PREFIXES = ("/v1/", "/admin/")
CLIENT_GONE = 499


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


def configure() -> None:
    """Access lines to stdout, bare JSON (not the server log's format), not duplicated there."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def write(info: AccessInfo, method: str, path: str, status: int, request_id: str | None) -> None:
    now = time.monotonic()
    line = {"ts": round(time.time(), 3), "request_id": request_id, "id": info.id,
            "method": method, "path": path, "status": status, "tenant": info.tenant,
            "model": info.model, "stream": info.stream, "prompt_tokens": info.prompt_tokens,
            "completion_tokens": info.completion_tokens, "finish_reason": info.finish_reason,
            "ttft_ms": None if info.first_output is None
            else round(1000 * (info.first_output - info.started), 1),
            "latency_ms": round(1000 * (now - info.started), 1)}
    if info.stream_error is not None:
        line["stream_error"] = info.stream_error
    log.info(msgspec.json.encode(line).decode())
