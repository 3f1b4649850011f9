"""Server: wires the actors together and runs their lifecycle.

    start HTTP (liveness answers at once; readiness says "loading")
    -> load the engine in a thread -> start actors -> warm-up step -> ready
    SIGTERM/SIGINT -> not ready, new requests 503 -> running requests finish (bounded by
    drain_timeout_s; the rest are aborted) -> exit 0

All actors run on one event loop; the model runs in the executor's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from tinyserve.actors.admission import Admission
from tinyserve.actors.batcher import Batcher
from tinyserve.actors.executor import Executor
from tinyserve.actors.ingress import Ingress
from tinyserve.actors.metrics import Metrics
from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.engine.sampling import SamplingParams
from tinyserve.messages import AbortAll, Output, Rejected, Submit

log = logging.getLogger(__name__)


class Server:
    def __init__(self, cfg: ServerConfig, engine_cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine_cfg = engine_cfg
        self.model_name = cfg.served_model_name or (
            Path(engine_cfg.model).name if engine_cfg.model else "tinyserve-demo")
        # Filled in once the engine is loaded; until then handlers answer 503.
        self.info = None
        self.tokenizer = None
        self.metrics: Metrics | None = None
        self.admission: Admission | None = None
        self.batcher: Batcher | None = None
        self.executor: Executor | None = None
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start_http(self) -> None:
        self._runner = web.AppRunner(Ingress(self).app(), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def load(self) -> None:
        from tinyserve.core.engine import CoreConfig, EngineCore
        from tinyserve.engine.engine import Engine

        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(None, Engine, self.engine_cfg)
        info = engine.info
        core = EngineCore(CoreConfig.from_engine(self.engine_cfg, info), engine.tokenizer)
        capacity = self.engine_cfg.max_num_seqs + self.cfg.max_waiting
        self.metrics = Metrics(info.max_model_len, self.engine_cfg.max_num_batched_tokens)
        self.metrics.set_cache_config(info.block_size, info.num_kv_blocks)
        self.executor = Executor(engine.runner.execute)
        self.batcher = Batcher(core, self.executor.inbox, self.metrics, capacity,
                               self.cfg.batch_timeout_ms)
        self.executor.outbox = self.batcher.inbox
        self.admission = Admission(self.batcher.inbox, lambda: self.batcher.num_requests, capacity)
        self.tokenizer = engine.tokenizer
        self.executor.start()
        for name, coro in (("metrics", self.metrics.run()), ("batcher", self.batcher.run()),
                           ("admission", self.admission.run())):
            self._tasks.append(loop.create_task(coro, name=name))
        self.info = info
        await self._warm_up()
        self.admission.ready = True
        log.info("model %r ready: max_model_len %d, KV %d blocks x %d tokens (%.1f MiB)%s",
                 self.model_name, info.max_model_len, info.num_kv_blocks, info.block_size,
                 info.kv_cache_bytes / 2**20,
                 " - DEMO MODEL WITH RANDOM WEIGHTS" if info.random_weights else "")

    async def _warm_up(self) -> None:
        """One real request through batcher and executor before we report ready."""
        t0 = time.perf_counter()
        replies: asyncio.Queue = asyncio.Queue(maxsize=8)
        prompt = (self.tokenizer.bos_token_id or 0,) * 2
        await self.batcher.inbox.put(Submit("warmup", prompt, SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True), time.monotonic(), replies,
            internal=True))
        while True:
            msg = await replies.get()
            if isinstance(msg, Rejected) or (isinstance(msg, Output) and msg.finish_reason):
                break
        if isinstance(msg, Rejected) or msg.finish_reason == "error":
            raise RuntimeError(f"warm-up step failed: {msg}")
        log.info("warm-up done in %.2fs", time.perf_counter() - t0)

    def request_stop(self) -> None:
        if self.admission is not None:
            self.admission.draining = True
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def drain(self) -> None:
        """Let running requests finish (up to drain_timeout_s), then abort what is left."""
        if self.batcher is None:
            return
        log.info("draining: %d requests in flight", self.batcher.num_requests)
        try:
            await asyncio.wait_for(self.batcher.wait_idle(), self.cfg.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timeout: aborting %d requests", self.batcher.num_requests)
            self.batcher.inbox.put_nowait(AbortAll())
            await asyncio.sleep(0.1)  # let the aborted streams write their last chunk

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.executor is not None:
            await self.executor.stop()


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
