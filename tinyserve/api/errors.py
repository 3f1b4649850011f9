"""The error envelope: every refusal the API makes is an ``ApiError``, answered as OpenAI
answers errors, ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status, and a
``Retry-After`` header when waiting can help. Under ``/v1/messages`` (Anthropic's API) the same
error is answered in Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``,
with its types, and 529 ``overloaded_error`` where OpenAI's routes say 503.

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


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag="error", tag_field="type"):
    """Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``."""

    error: AnthropicErrorInfo


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

    def envelope(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))

    def body(self) -> bytes:
        return msgspec.json.encode(self.envelope())

    # -- Anthropic's envelope (the Messages API)
    @property
    def anthropic_status(self) -> int:
        return 529 if self.status == 503 else self.status  # overloaded: shedding, loading

    def anthropic_envelope(self) -> AnthropicError:
        status = self.anthropic_status
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                    else "api_error")
        return AnthropicError(AnthropicErrorInfo(kind, self.message))

    def response_for(self, path: str) -> tuple[int, bytes]:
        """(status, body) as the API this path belongs to answers errors."""
        if path.startswith(ANTHROPIC_PREFIX):
            return self.anthropic_status, msgspec.json.encode(self.anthropic_envelope())
        return self.status, self.body()

    @classmethod
    def from_field(cls, e: FieldError, param: str | None = None) -> ApiError:
        """A value the engine refused: a 400 naming its field (or ``param``, the API's name
        for it where the two differ)."""
        return cls(400, str(e), param=param or e.field, code=e.code)

    @classmethod
    def from_failed(cls, f: Failed) -> ApiError:
        """A request the server ended (admission, engine, fault) with this error."""
        return cls(f.status, f.message, f.param, retry_after=f.retry_after)
