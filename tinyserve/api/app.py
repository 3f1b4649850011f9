r"""The HTTP face as the server sees it: the aiohttp application (routes and middlewares), the
loaded models once the server sets them, and the requests still waiting on an answer.

    POST /v1/completions, /v1/chat/completions   openai/routes.py   \  pipeline.py (auth, decode,
    POST /v1/responses                           responses/routes.py > prepare.py) -> generate.py
    POST /v1/messages                            anthropic/routes.py/  (-> sse.py, or the fold)
    GET, DELETE /v1/responses/{id}               responses/routes.py (store.py)
    POST /v1/messages/count_tokens               anthropic/routes.py
    GET  /v1/models, /v1/models/{id}             openai/models.py
    POST /tokenize, /detokenize                  openai/tokenize.py
    GET  /openapi.json                           ops/openapi.py
    GET  /health, /ready, /metrics               ops/probes.py
    GET, POST /admin/routes                      ops/routes.py
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   ops/loras.py
"""

from __future__ import annotations

from aiohttp import web

from tinyserve import __version__
from tinyserve.api.anthropic.routes import MessagesRoutes
from tinyserve.api.context import ApiContext, Serving, json_response
from tinyserve.api.generate import Generator
from tinyserve.api.middleware import middlewares
from tinyserve.api.openai.models import ModelRoutes
from tinyserve.api.openai.routes import CompletionRoutes
from tinyserve.api.openai.tokenize import TokenizeRoutes
from tinyserve.api.ops.loras import LoraAdminRoutes
from tinyserve.api.ops.openapi import openapi_spec
from tinyserve.api.ops.probes import Probes
from tinyserve.api.ops.routes import AdminRoutes
from tinyserve.api.responses.routes import ResponsesRoutes
from tinyserve.config import ServerConfig


class Api:
    def __init__(self, cfg: ServerConfig) -> None:
        self.ctx = ApiContext(cfg)
        self.generator = Generator(self.ctx)

    @property
    def serving(self) -> Serving | None:
        return self.ctx.serving

    @serving.setter
    def serving(self, serving: Serving) -> None:
        self.ctx.serving = serving

    @property
    def num_live(self) -> int:
        """Requests with a handler waiting on them (the drain waits for none)."""
        return self.generator.num_live

    def fail_all(self, status: int, message: str, model: str | None = None) -> None:
        """Answer every pending request (of one model, if given) with this error now: the
        supervisor's last resort, or a model that went down."""
        self.generator.fail_all(status, message, model)

    def app(self) -> web.Application:
        ctx = self.ctx
        chain = middlewares(ctx.cfg.access_log, ctx.count_error, ctx.count_answer)
        app = web.Application(middlewares=chain,
                              client_max_size=ctx.cfg.max_body_bytes)
        gen, models, tokens = CompletionRoutes(ctx, self.generator), ModelRoutes(ctx), \
            TokenizeRoutes(ctx)
        responses = ResponsesRoutes(ctx, self.generator)
        probes, admin = Probes(ctx), AdminRoutes(ctx)
        anthropic = MessagesRoutes(ctx, self.generator)
        loras = LoraAdminRoutes(ctx)
        add = {"GET": app.router.add_get, "POST": app.router.add_post,  # (GET: HEAD too)
               "DELETE": app.router.add_delete}
        for method, path, handler in (
                ("POST", "/v1/chat/completions", gen.chat_completions),
                ("POST", "/v1/completions", gen.completions),
                ("POST", "/v1/messages", anthropic.messages),
                ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
                ("POST", "/v1/responses", responses.create),
                ("GET", "/v1/responses/{response_id}", responses.get),
                ("DELETE", "/v1/responses/{response_id}", responses.delete),
                ("GET", "/v1/models", models.models),
                ("GET", "/v1/models/{model_id:.+}", models.model),
                ("POST", "/tokenize", tokens.tokenize),
                ("POST", "/detokenize", tokens.detokenize),
                ("GET", "/openapi.json", _openapi),
                ("GET", "/health", probes.health),
                ("GET", "/ready", probes.ready),
                ("GET", "/metrics", probes.metrics),
                ("GET", "/admin/routes", admin.get_routes),
                ("POST", "/admin/routes", admin.set_routes),
                ("POST", "/v1/load_lora_adapter", loras.load),
                ("POST", "/v1/unload_lora_adapter", loras.unload)):
            add[method](path, handler)
        return app


async def _openapi(request: web.Request) -> web.Response:
    return json_response(openapi_spec(__version__))
