"""The error envelope: every refusal the API makes is an ``ApiError``, answered as OpenAI
answers errors, ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status, and a
``Retry-After`` header when waiting can help.

``param`` names the request field at fault. It is never recovered from a message's text:
engine-side checks raise ``messages.FieldError``, which carries its field, and ``from_field``
turns one into a 400.
"""

from __future__ import annotations

import msgspec

from tinyserve.messages import Failed, FieldError

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ApiError(Exception):
    """An error to return in the OpenAI envelope with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500
                          else "server_error")

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(ErrorInfo(self.message, self.type,
                                                           self.param, self.code)))

    @classmethod
    def from_field(cls, e: FieldError, param: str | None = None) -> ApiError:
        """A value the engine refused: a 400 naming its field (or ``param``, the API's name
        for it where the two differ)."""
        return cls(400, str(e), param=param or e.field, code=e.code)

    @classmethod
    def from_failed(cls, f: Failed) -> ApiError:
        """A request the server ended (admission, engine, fault) with this error."""
        return cls(f.status, f.message, f.param, retry_after=f.retry_after)
