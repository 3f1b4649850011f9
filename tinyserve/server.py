"""Server: wires the actors together and runs their lifecycle.

    start HTTP (liveness answers at once; readiness says "loading")
    -> load the engine in a thread -> start actors under the supervisor -> warm-up -> ready
    SIGTERM/SIGINT -> not ready, new requests 503 -> running requests finish (bounded by
    drain_timeout_s; the rest end with 503) -> exit 0

All actors run on one event loop; the models run in the executor's one worker thread, in
turn. Each served model has its own engine (weights, KV pool share), engine core (scheduler),
batcher and SLO controller; admission, the API, metrics and the supervisor are shared.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import signal
import time
from collections.abc import Sequence

from aiohttp import web

from tinyserve.actors.admission import Admission
from tinyserve.actors.batcher import Batcher
from tinyserve.actors.executor import Executor
from tinyserve.actors.lanes import Lane, RequestHandle
from tinyserve.actors.metrics import Metrics
from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.actors.supervisor import Supervisor
from tinyserve.api.app import Api
from tinyserve.api.context import Serving
from tinyserve.api.prompts import PromptParser
from tinyserve.config import ModelSpec, ServerConfig
from tinyserve.core.adapters import AdapterRegistry
from tinyserve.core.engines import Engine
from tinyserve.core.routing import Router, describe
from tinyserve.core.slo import SloController
from tinyserve.messages import AbortAll, Failed, Output, SamplingParams, Submit

log = logging.getLogger(__name__)

WARMUP_ID = 0  # the API numbers requests from 1
PROBE_S, PROBE_MAX_S = 5.0, 60.0  # a down model is probed after this long, then less often
PROBE_STABLE_S = 60.0  # up this long after a probe: the next failure starts the backoff anew


class Server:
    def __init__(self, cfg: ServerConfig, models: Sequence[ModelSpec],
                 engines: dict[str, Engine] | None = None, freeze_heap: bool = False) -> None:
        """``models``: what to serve (``cli.models.build_models``). ``engines``: already built
        engines by model name (core/engines.py's Engine; tests pass fake ones). Models
        without one are built from their EngineConfig in ``load``."""
        self.cfg = cfg
        self.freeze_heap = freeze_heap  # gc.freeze once warmed up: only a process of its own
        self.models = tuple(models)
        self._engines = dict(engines or {})
        # Checks names, routes and fallbacks before anything loads (ValueError).
        self.router = Router([m.name for m in self.models], cfg.routes, cfg.fallbacks,
                             adapters=[name for name, _, _ in cfg.lora_modules])
        self.api = Api(cfg)
        self.metrics: Metrics | None = None
        self.admission: Admission | None = None
        self.batchers: dict[str, Batcher] = {}
        self.executor: Executor | None = None
        self.supervisor: Supervisor | None = None
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._tokenizers: dict[str, Engine] = {}
        self._probes: set[asyncio.Task] = set()
        self._probe_delay: dict[str, float] = {}  # the wait before a down model's next probe
        self._up_since: dict[str, float] = {}  # when a probe last brought a model back
        self._probe_ids = itertools.count(-1, -1)  # the API numbers requests from 1

    @property
    def batcher(self) -> Batcher:
        """The first model's batcher (the only one, in a one-model server)."""
        return next(iter(self.batchers.values()))

    async def start_http(self) -> None:
        self._runner = web.AppRunner(self.api.app(), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def load(self) -> None:
        """Load every model, start the actors, warm up, then report ready."""
        loop = asyncio.get_running_loop()
        engines = {}
        for spec in self.models:  # one at a time: each sizes its KV from what is left
            engine = self._engines.get(spec.name)
            if engine is None:
                from tinyserve.engine.device_engine import DeviceEngine

                engine = await loop.run_in_executor(None, DeviceEngine, spec.engine)
            engines[spec.name] = engine
        self._check_fallbacks(engines)
        self._tokenizers = {name: e.tokenizer for name, e in engines.items()}
        self._start_actors(engines)
        roots = {spec.name: spec.engine.resolved_model for spec in self.models}
        parsers = {name: PromptParser(e.info.max_model_len, e.info.vocab_size, e.tokenizer,
                                      roots[name], e.grammars,
                                      self.cfg.tool_call_parser,
                                      self.cfg.special_tokens_in_content)
                   for name, e in engines.items()}
        self.api.serving = Serving(parsers, self.admission, self.router, self.metrics,
                                   self.supervisor, self._adapters(engines))
        self._log_setup()
        for spec in self.models:
            # every kernel specialization, before the first request, on the thread that runs
            # the steps (CUDA graphs are captured there)
            await self.executor.call_on_worker(engines[spec.name].warm_up)
            await self._warm_up(spec.name, engines[spec.name].tokenizer)
        if self.freeze_heap:
            # Everything alive now (weights, kernels, tokenizers, the interpreter's caches)
            # lives as long as the process: freezing it keeps the collector from walking it
            # again. A full collection over that heap stalled the event loop 100+ ms at a time.
            gc.collect()
            gc.freeze()
        self.admission.ready = True
        for name, e in engines.items():
            info = e.info
            log.info("model %r ready: max_model_len %d, KV %d blocks x %d tokens (%.1f MiB, %s)%s%s",
                     name, info.max_model_len, info.num_kv_blocks, info.block_size,
                     info.kv_cache_bytes / 2**20, info.kv_cache_dtype,
                     f", {info.quantization}" if info.quantization else "",
                     " - DEMO MODEL WITH RANDOM WEIGHTS" if info.random_weights else "")

    def _start_actors(self, engines: dict[str, Engine]) -> None:
        """Metrics, the executor over every model's runner, a batcher and a lane per model,
        admission over the lanes, and the supervisor watching them all."""
        from tinyserve.core.engine_core import CoreConfig, EngineCore

        infos = {name: e.info for name, e in engines.items()}
        self.metrics = Metrics(max(i.max_model_len for i in infos.values()),
                               max(m.engine.max_num_batched_tokens for m in self.models),
                               namespace=self.cfg.metrics_namespace,
                               lora=any(i.max_loras for i in infos.values()),
                               speculation=any(i.speculative for i in infos.values()),
                               moe=any(i.num_experts for i in infos.values()))
        self.executor = Executor({name: e.runner for name, e in engines.items()})
        lanes = []
        for spec in self.models:
            info, ecfg = infos[spec.name], spec.engine
            self.metrics.set_cache_config(spec.name, info.block_size, info.num_kv_blocks,
                                          info.kv_cache_dtype)
            core = EngineCore(CoreConfig.from_engine(ecfg, info), engines[spec.name].tokenizer)
            capacity = ecfg.max_num_seqs + self.cfg.max_waiting
            slo = SloController(_seconds(self.cfg.slo_ttft_ms), _seconds(self.cfg.slo_itl_ms),
                                capacity)
            batcher = Batcher(core, self.executor.inbox, self.metrics, capacity,
                              self.cfg.batch_timeout_ms, slo, spec.name,
                              # a verify's accepted count is what its next step starts from:
                              # with speculation each step is planned once the last returned
                              self.cfg.overlap and info.speculative is None,
                              self.cfg.stream_interval, self.cfg.stream_write_rate)
            self.batchers[spec.name] = batcher
            self.executor.outboxes[spec.name] = batcher.inbox
            lane = Lane(spec.name, batcher.inbox, capacity, info.max_model_len, slo,
                        self.router.fallbacks.get(spec.name))
            slo.pressure = lambda lane=lane: lane.refused  # read when a window closes
            lanes.append(lane)
        self.supervisor = Supervisor(self.executor, self._on_fatal, self.cfg.step_timeout_s,
                                     self.cfg.max_failed_steps, self._on_model_down)
        self.admission = Admission(lanes, lambda: self.supervisor.failure, self.cfg.tenant_list,
                                   self.metrics.emit)
        self.supervisor.watch(self.executor.start())
        actors = [("metrics", self.metrics.run()), ("admission", self.admission.run()),
                  ("supervisor", self.supervisor.run())]
        actors += [(f"batcher[{name}]", b.run()) for name, b in self.batchers.items()]
        loop = asyncio.get_running_loop()
        for name, coro in actors:
            self.supervisor.watch(loop.create_task(coro, name=name))

    def _log_setup(self) -> None:
        for t in self.cfg.tenants:  # keys are never logged: a short hash tells them apart
            log.info("tenant %s: key sha256:%s, priority %d, max_concurrent %s, "
                     "tokens_per_minute %s, cache_group %r%s%s", t.name, t.key_id, t.priority,
                     t.max_concurrent, t.tokens_per_minute, t.cache_salt.decode(),
                     ", degradable" if t.degradable else "", ", admin" if t.admin else "")
        for alias, weights in self.router.routes.items():
            log.info("route %s: %s", alias, describe(weights))
        for name, other in self.router.fallbacks.items():
            log.info("fallback %s -> %s (degradable tenants, while %s is degraded or down)",
                     name, other, name)

    def _adapters(self, engines: dict[str, Engine]) -> dict[str, AdapterRegistry]:
        """Each model that serves LoRA adapters: its registry, with the --lora-modules
        loaded (ValueError: one that does not fit, or a name already taken)."""
        registries = {name: AdapterRegistry(name, e.info.lora_dims, e.info.max_lora_rank,
                                            reader=e.read_adapter)
                      for name, e in engines.items() if e.info.max_loras}
        taken = set(engines) | set(self.router.routes)
        for name, path, base in self.cfg.lora_modules:
            base = base or self.models[0].name
            if base not in engines:
                raise ValueError(f"--lora-modules {name}: no served model {base!r}")
            if base not in registries:
                raise ValueError(f"--lora-modules {name}: {base} serves no adapters "
                                 "(--enable-lora / --max-loras)")
            if name in taken:
                raise ValueError(f"--lora-modules {name}: the name is already a model or route")
            registries[base].load(name, path)
            taken.add(name)
            log.info("LoRA adapter %r on %s from %s", name, base, path)
        return registries

    def _check_fallbacks(self, engines: dict[str, Engine]) -> None:
        """A fallback serves prompts tokenized (and bounded by the vocabulary) for the other
        model: tokenizers and vocabularies must agree."""
        for name, other in self.router.fallbacks.items():
            a, b = engines[name], engines[other]
            if (a.tokenizer.fingerprint != b.tokenizer.fingerprint
                    or a.info.vocab_size != b.info.vocab_size):
                raise ValueError(f"--fallback {name}={other}: the two models' tokenizers or "
                                 "vocabularies differ; a fallback must read prompts the same way")

    def _on_model_down(self, model: str, reason: str) -> None:
        """Its steps keep failing while others serve: answer what it holds, route around it,
        and probe it until a step runs again. A model that fails again soon after a probe
        brought it back keeps doubling its wait (a probe can pass where real traffic fails)."""
        self.admission.lanes[model].down = reason
        self.api.fail_all(503, f"the model {model} is unavailable: {reason}", model)
        recently_up = time.monotonic() - self._up_since.get(model, -PROBE_STABLE_S) < PROBE_STABLE_S
        delay = min(PROBE_MAX_S, 2 * self._probe_delay[model]) if recently_up else PROBE_S
        self._probe_delay[model] = delay
        task = asyncio.get_running_loop().create_task(self._probe(model), name=f"probe[{model}]")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, model: str) -> None:
        """After the model's probe delay (doubling up to PROBE_MAX_S), one request of the
        server's own; the first that runs brings the model back (that step reset its failure
        count)."""
        lane = self.admission.lanes[model]
        while True:
            await asyncio.sleep(self._probe_delay[model])
            if self.supervisor.failure or self.admission.draining:
                return
            try:
                async with asyncio.timeout(self.cfg.step_timeout_s + 5):
                    await self._warm_up(model, self._tokenizers[model], next(self._probe_ids))
            except (RuntimeError, TimeoutError) as e:
                delay = self._probe_delay[model] = min(PROBE_MAX_S, 2 * self._probe_delay[model])
                log.warning("model %s: probe failed (%s); next in %gs", model, e, delay)
                continue
            lane.down = None
            self._up_since[model] = time.monotonic()
            self.supervisor.up(model)
            return

    def _on_fatal(self, reason: str) -> None:
        self.api.fail_all(503, f"the server is unhealthy: {reason}")

    async def _warm_up(self, model: str, tokenizer, rid: int = WARMUP_ID) -> None:
        """One real request through admission, batcher and executor (before we report ready,
        and to probe a model that is down); RuntimeError if it fails. Cancelled (a probe's
        timeout), it is taken back out of wherever it is."""
        t0 = time.perf_counter()
        handle = RequestHandle(rid, ReplyQueue(maxsize=8))
        prompt = (tokenizer.bos_token_id or 0,) * 2
        submit = Submit(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True), arrival_time=time.monotonic(),
            handle=handle, model=model, internal=True)
        try:
            msg = await self.admission.ask((submit,), wait=True)
            while not isinstance(msg, Failed):
                msg = await handle.replies.get()
                if isinstance(msg, Output) and msg.finish_reason:
                    break
            handle.done = True
        finally:
            handle.close()
        if isinstance(msg, Failed):
            raise RuntimeError(f"{model}: warm-up step failed: {msg.message}")
        log.info("%s: warm-up done in %.2fs", model, time.perf_counter() - t0)

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
        if not self.batchers:
            return
        log.info("draining: %d requests in flight", self.api.num_live)
        if not await self._until_no_live(self.cfg.drain_timeout_s):
            log.warning("drain timeout: ending %d requests with 503", self.api.num_live)
            for batcher in self.batchers.values():
                batcher.inbox.put_nowait(AbortAll(503, "the server is shutting down"))
            # Their handlers write the error (bounded: a stuck client must not hold us).
            await self._until_no_live(2.0)

    async def _until_no_live(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.api.num_live:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        if self.freeze_heap:
            # Back under the collector: frozen objects outlive their extension types'
            # teardown at exit (nanobind reports leaks). Closing twice is harmless.
            gc.unfreeze()
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.executor is not None:
            await self.executor.stop()


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


async def serve(cfg: ServerConfig, models: Sequence[ModelSpec]) -> int:
    server = Server(cfg, models, freeze_heap=True)  # the process is the server's own
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
