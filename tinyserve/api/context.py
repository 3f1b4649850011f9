"""What every handler shares: the server's configuration, the loaded models (``Serving``,
None until they are loaded: handlers answer 503 until then), the bound on requests being read
and parsed at once, reading a request's body and answering JSON."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from tinyserve.api.errors import ApiError
from tinyserve.config import ServerConfig
from tinyserve.messages import ApiAnswered, RequestFailed

if TYPE_CHECKING:
    from tinyserve.actors.admission import Admission
    from tinyserve.actors.metrics import Metrics
    from tinyserve.actors.supervisor import Supervisor
    from tinyserve.api.prompts import PromptParser
    from tinyserve.core.adapters import AdapterRegistry, AdapterSpec
    from tinyserve.core.routing import Router

CLIENT_ID = web.RequestKey("client_id", str)  # X-Request-Id: echoed and logged, never a key
MAX_PARSING = 64  # requests reading / checking / tokenizing at once; the rest wait their turn


@dataclass(slots=True)
class Serving:
    """What the handlers talk to once the models are loaded."""

    parsers: dict[str, PromptParser]  # by served model name
    admission: Admission  # and its lanes: one per model, with that model's batcher inbox
    router: Router  # the admin route handler is its only writer (POST /admin/routes)
    metrics: Metrics
    supervisor: Supervisor
    # base model -> its LoRA adapters (only the models that serve some)
    adapters: dict[str, AdapterRegistry] = field(default_factory=dict)

    def adapter(self, name: str) -> tuple[str, AdapterSpec] | None:
        """(base model, adapter) for an adapter's name, or None."""
        for base, registry in self.adapters.items():
            spec = registry.get(name)
            if spec is not None:
                return base, spec
        return None


class ApiContext:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.serving: Serving | None = None
        # Bounds the work (and body memory) before admission: waiting handlers hold only
        # their socket, since aiohttp reads a body when asked to.
        self.parsing = asyncio.Semaphore(MAX_PARSING)

    def serving_or_503(self) -> Serving:
        if self.serving is None:
            raise ApiError(503, "the model is still loading", retry_after=5.0)
        return self.serving

    def healthy(self) -> Serving:
        """The loaded models, or a 503 (loading, or the supervisor saw a fatal fault)."""
        serving = self.serving_or_503()
        if serving.supervisor.failure:
            raise ApiError(503, f"the server is unhealthy: {serving.supervisor.failure}",
                           retry_after=5.0)
        return serving

    def count_error(self, e: ApiError) -> None:
        if self.serving is not None:
            self.serving.metrics.emit(RequestFailed(str(e.status)))

    def count_answer(self, endpoint: str, status: int) -> None:
        if self.serving is not None:
            self.serving.metrics.emit(ApiAnswered(endpoint, str(status)))


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match
        raise ApiError(400, f"could not read the request body: {e}") from None


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")
