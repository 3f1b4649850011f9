"""vLLM's runtime LoRA routes (admin tenants): ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"[, "base_model_name"]}`` checks a PEFT directory against the base
model and serves it as ``lora_name``; ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``
takes it away: new requests no longer see it at once, and the answer waits (at most
UNLOAD_WAIT_S, else a 409 and the adapter stays) until no request still runs with it, so no
request ever sees half an adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from tinyserve.api.auth import authenticate_admin
from tinyserve.api.context import ApiContext, Serving, read_body
from tinyserve.api.decode import decode_request
from tinyserve.api.errors import ApiError

log = logging.getLogger(__name__)

UNLOAD_WAIT_S = 30.0  # an unload waits this long for the requests still using the adapter


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/load_lora_adapter``: serve a PEFT directory as a model name."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # several served models: which one it adapts
    load_inplace: bool = False  # vLLM's; replacing a loaded adapter's weights is refused


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; unused


class LoraAdminRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    async def load(self, request: web.Request) -> web.Response:
        tenant = authenticate_admin(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        req = decode_request(await read_body(request), LoadLoraRequest)
        if req.load_inplace:
            raise ApiError(400, "load_inplace is not supported: unload the adapter, then load "
                           "it again", param="load_inplace", code="unsupported_parameter")
        registry = _registry(serving, req.base_model_name)
        name = req.lora_name
        if name in serving.parsers or name in serving.router.routes or serving.adapter(name):
            raise ApiError(400, f"the name {name!r} is already a model, a route or an adapter",
                           param="lora_name")
        try:  # (reads the adapter's config and the safetensors header: small files)
            spec = await asyncio.get_running_loop().run_in_executor(
                None, registry.load, name, req.lora_path)
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        serving.router.adapters.add(name)
        log.warning("LoRA adapter %r loaded on %s from %s (rank %d; by tenant %s)", name,
                    registry.base_model, spec.path, spec.rank, tenant.name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        tenant = authenticate_admin(request, self._ctx.cfg.tenant_list)
        serving = self._ctx.serving_or_503()
        req = decode_request(await read_body(request), UnloadLoraRequest)
        found = serving.adapter(req.lora_name)
        if found is None:
            raise ApiError(404, f"no LoRA adapter named {req.lora_name!r}", param="lora_name",
                           code="model_not_found")
        registry = serving.adapters[found[0]]
        registry.start_unload(req.lora_name)  # new requests: 404 from here on
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while registry.in_use.get(req.lora_name) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if registry.in_use.get(req.lora_name):
            registry.cancel_unload(req.lora_name)
            raise ApiError(409, f"the adapter {req.lora_name!r} is still used by "
                           f"{registry.in_use[req.lora_name]} requests after {UNLOAD_WAIT_S:g}"
                           " s; it stays loaded", param="lora_name")
        registry.finish_unload(req.lora_name)
        serving.router.adapters.discard(req.lora_name)
        log.warning("LoRA adapter %r unloaded from %s (by tenant %s)", req.lora_name,
                    registry.base_model, tenant.name)
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")


def _registry(serving: Serving, base: str | None):
    if not serving.adapters:
        raise ApiError(400, "no served model takes LoRA adapters (--enable-lora)",
                       code="unsupported_parameter")
    if base is None:
        if len(serving.adapters) > 1:
            raise ApiError(400, "several models take adapters: name one in base_model_name",
                           param="base_model_name")
        return next(iter(serving.adapters.values()))
    if base not in serving.adapters:
        raise ApiError(404, f"no served model {base!r} takes LoRA adapters",
                       param="base_model_name", code="model_not_found")
    return serving.adapters[base]
