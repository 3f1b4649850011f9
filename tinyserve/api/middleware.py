"""What wraps every handler, outermost first:

- access log (``--access-log``): one JSON line per API request, with the status finally sent;
- per-route count: every API request's route and final status (a metric);
- request id: the client's ``X-Request-Id`` if well-formed (echoed and logged, never a key),
  else a fresh one;
- error envelope: an ApiError, or aiohttp's own 404/405/413, answered in the OpenAI envelope;
  anything else is logged and answered 500;
- JSON bodies only: a POST whose Content-Type is not JSON is refused (415) before its handler
  runs. A browser sends ``text/plain``, form-encoded and multipart bodies cross-origin without
  a CORS preflight, so without this check any web page a user visits could make a keyless
  local server run requests (admin routes included) by posting JSON as plain text.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from tinyserve.api import access_log
from tinyserve.api.access_log import ACCESS
from tinyserve.api.context import CLIENT_ID
from tinyserve.api.errors import ApiError

log = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
Handler = Callable[[web.Request], "asyncio.Future[web.StreamResponse]"]


def middlewares(access: bool, count_error: Callable[[ApiError], None],
                count_answer: Callable[[str, int], None]) -> list:
    """The middleware chain, outermost first (``access``: with the access log)."""
    chain = [_request_id, _counted(count_answer), _error_envelope(count_error), _json_only]
    return [_access_line, *chain] if access else chain


def error_response(e: ApiError, path: str = "") -> web.Response:
    """The error as the API of ``path`` answers it (OpenAI's envelope, or Anthropic's under
    /v1/messages)."""
    status, body = e.response_for(path)
    resp = web.Response(body=body, status=status, content_type="application/json")
    if e.retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, round(e.retry_after)))
    return resp


@web.middleware
async def _access_line(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith(access_log.LOGGED_PREFIXES):
        return await handler(request)
    info = request[ACCESS] = access_log.AccessInfo(time.monotonic())
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = access_log.CLIENT_GONE
        raise
    finally:
        access_log.write(info, request.method, request.path, status, request.get(CLIENT_ID))


@web.middleware
async def _request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    given = request.headers.get("X-Request-Id", "")
    request[CLIENT_ID] = given if _REQUEST_ID_OK.match(given) else uuid.uuid4().hex
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["X-Request-Id"] = request[CLIENT_ID]
    return resp


def _counted(count_answer: Callable[[str, int], None]):
    @web.middleware
    async def counted(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(access_log.LOGGED_PREFIXES):
            return await handler(request)
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        status = access_log.CLIENT_GONE
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        finally:
            count_answer(endpoint, status)

    return counted


def _error_envelope(count_error: Callable[[ApiError], None]):
    @web.middleware
    async def envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            count_error(e)
            return error_response(e, request.path)
        except web.HTTPException as e:  # 404/405/413 from aiohttp, in the API's envelope
            if e.status >= 400:
                err = ApiError(e.status, e.reason or "error")
                count_error(err)
                return error_response(err, request.path)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s (X-Request-Id %s)", request.method,
                          request.path, request.get(CLIENT_ID))
            err = ApiError(500, "internal server error")
            count_error(err)
            return error_response(err, request.path)

    return envelope


@web.middleware
async def _json_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method == "POST" and request.match_info.http_exception is None:
        kind = request.content_type  # (aiohttp: application/octet-stream when absent)
        if not (kind == "application/json" or (kind.startswith("application/")
                                                and kind.endswith("+json"))):
            raise ApiError(415, f"Content-Type must be application/json, got "
                           f"{request.headers.get('Content-Type', 'none')[:80]!r}",
                           code="unsupported_media_type")
    return await handler(request)
