"""Server: wires the actors together and runs their lifecycle.

    start HTTP (liveness answers at once; readiness says "loading")
    -> load the engine in a thread -> start actors under the supervisor -> warm-up -> ready
    SIGTERM/SIGINT -> not ready, new requests 503 -> running requests finish (bounded by
    drain_timeout_s; the rest end with 503) -> exit 0

All actors run on one event loop; the model runs in the executor's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from tinyserve.actors.admission import Admission
from tinyserve.actors.batcher import Batcher
from tinyserve.actors.executor import Executor
from tinyserve.actors.ingress import Backend, Ingress
from tinyserve.actors.metrics import Metrics
from tinyserve.actors.supervisor import Supervisor
from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.core.slo import SloController
from tinyserve.messages import AbortAll, Failed, Output, SamplingParams, Submit
from tinyserve.prompts import PromptParser

log = logging.getLogger(__name__)

WARMUP_ID = 0  # ingress numbers requests from 1


class Server:
    def __init__(self, cfg: ServerConfig, engine_cfg: EngineConfig, engine: Any = None) -> None:
        """``engine``: an already built engine (``info``, ``tokenizer``, ``runner.execute``);
        tests pass a fake one. None: build the real one from ``engine_cfg`` in ``load``."""
        self.cfg = cfg
        self.engine_cfg = engine_cfg
        self._engine = engine
        self.model_name = cfg.served_model_name or Path(engine_cfg.resolved_model).name
        self.ingress = Ingress(cfg, self.model_name)
        self.metrics: Metrics | None = None
        self.admission: Admission | None = None
        self.batcher: Batcher | None = None
        self.executor: Executor | None = None
        self.supervisor: Supervisor | None = None
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start_http(self) -> None:
        self._runner = web.AppRunner(self.ingress.app(), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def load(self) -> None:
        from tinyserve.core.engine import CoreConfig, EngineCore

        loop = asyncio.get_running_loop()
        engine = self._engine
        if engine is None:
            from tinyserve.engine.engine import Engine

            engine = await loop.run_in_executor(None, Engine, self.engine_cfg)
        info = engine.info
        core = EngineCore(CoreConfig.from_engine(self.engine_cfg, info), engine.tokenizer)
        capacity = self.engine_cfg.max_num_seqs + self.cfg.max_waiting
        self.metrics = Metrics(info.max_model_len, self.engine_cfg.max_num_batched_tokens)
        self.metrics.set_cache_config(info.block_size, info.num_kv_blocks)
        self.executor = Executor(engine.runner.execute)
        slo = SloController(_seconds(self.cfg.slo_ttft_ms), _seconds(self.cfg.slo_itl_ms),
                            capacity)
        self.batcher = batcher = Batcher(core, self.executor.inbox, self.metrics, capacity,
                                         self.cfg.batch_timeout_ms, slo)
        self.executor.outbox = batcher.inbox
        self.supervisor = Supervisor(self.executor, self._on_fatal, self.cfg.step_timeout_s,
                                     self.cfg.max_failed_steps)
        self.admission = Admission(
            batcher.inbox, lambda: self.ingress.aborts_sent - batcher.aborts_received, capacity,
            lambda: self.supervisor.failure, self.cfg.tenant_list, self.metrics.emit, slo)
        self.supervisor.watch(self.executor.start())
        for name, coro in (("metrics", self.metrics.run()), ("batcher", batcher.run()),
                           ("admission", self.admission.run()),
                           ("supervisor", self.supervisor.run())):
            self.supervisor.watch(loop.create_task(coro, name=name))
        parser = PromptParser(self.model_name, info.max_model_len, info.vocab_size,
                              engine.tokenizer)
        self.ingress.backend = Backend(parser, self.admission, batcher.inbox, self.metrics,
                                       self.supervisor)
        for t in self.cfg.tenants:  # keys are never logged: a short hash tells them apart
            log.info("tenant %s: key sha256:%s, priority %d, max_concurrent %s, "
                     "tokens_per_minute %s, cache_group %r%s", t.name, t.key_id, t.priority,
                     t.max_concurrent, t.tokens_per_minute, t.cache_salt.decode(),
                     ", degradable" if t.degradable else "")
        await self._warm_up(engine.tokenizer)
        self.admission.ready = True
        log.info("model %r ready: max_model_len %d, KV %d blocks x %d tokens (%.1f MiB)%s",
                 self.model_name, info.max_model_len, info.num_kv_blocks, info.block_size,
                 info.kv_cache_bytes / 2**20,
                 " - DEMO MODEL WITH RANDOM WEIGHTS" if info.random_weights else "")

    def _on_fatal(self, reason: str) -> None:
        self.ingress.fail_all(503, f"the server is unhealthy: {reason}")

    async def _warm_up(self, tokenizer) -> None:
        """One real request through admission, batcher and executor before we report ready."""
        t0 = time.perf_counter()
        replies: asyncio.Queue = asyncio.Queue(maxsize=8)
        prompt = (tokenizer.bos_token_id or 0,) * 2
        await self.admission.inbox.put(Submit(WARMUP_ID, prompt, SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True), time.monotonic(), replies,
            internal=True))
        while True:
            msg = await replies.get()
            if isinstance(msg, Failed) or (isinstance(msg, Output) and msg.finish_reason):
                break
        self.admission.release(WARMUP_ID)
        if isinstance(msg, Failed):
            raise RuntimeError(f"warm-up step failed: {msg.message}")
        log.info("warm-up done in %.2fs", time.perf_counter() - t0)

    def request_stop(self) -> None:
        if self.admission is not None:
            self.admission.draining = True
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def drain(self) -> None:
        """Let every request in flight finish (up to drain_timeout_s); the rest end with 503.

        "In flight" is every HTTP handler still waiting on a request, wherever it is: parsing,
        before admission, queued, running, or writing its last bytes."""
        if self.batcher is None:
            return
        log.info("draining: %d requests in flight", self.ingress.num_live)
        if not await self._until_no_live(self.cfg.drain_timeout_s):
            log.warning("drain timeout: ending %d requests with 503", self.ingress.num_live)
            self.batcher.inbox.put_nowait(AbortAll(503, "the server is shutting down"))
            # Their handlers write the error (bounded: a stuck client must not hold us).
            await self._until_no_live(2.0)

    async def _until_no_live(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.ingress.num_live:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.executor is not None:
            await self.executor.stop()


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


async def serve(cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    server = Server(cfg, engine_cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    await server.start_http()
    log.info("listening on http://%s:%d (not ready until the model is loaded)", cfg.host,
             server.port)
    load = loop.create_task(server.load())
    stop = loop.create_task(server.wait_stopped())
    await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        log.error("failed to load the model: %s", load.exception())
        await server.close()
        return 1
    await stop
    if not load.done():
        load.cancel()
    await server.drain()
    await server.close()
    log.info("stopped")
    return 0
