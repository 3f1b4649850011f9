"""Probes and metrics: ``/health`` (liveness), ``/ready`` (readiness with the degradation
status, from one ``Admission.readiness()`` snapshot) and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

from aiohttp import web

from tinyserve.api.context import ApiContext, json_response


class Probes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 503 once the supervisor has seen a fault only a restart can cure."""
        serving = self._ctx.serving
        failure = serving.supervisor.failure if serving is not None else None
        if failure:
            return json_response({"status": "unhealthy", "reason": failure}, 503)
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 while serving (``ready``, or ``degraded`` with the worst level and
        why, and each model's own), else 503 (loading, unhealthy, draining)."""
        serving = self._ctx.serving
        if serving is None:
            return json_response({"status": "loading"}, 503)
        ok, report = serving.admission.readiness()
        return json_response(report, 200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        serving = self._ctx.serving_or_503()
        return web.Response(body=serving.metrics.render(), headers={
            "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
