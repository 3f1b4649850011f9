"""Metrics actor: owns the Prometheus registry; other actors send it events.

Names follow vLLM's (``vllm:`` -> ``tinyserve:``) so dashboards and routers map one to one;
every series about a model's work carries its name as the label ``model``.
Events are sent with ``emit`` (never blocks: a full inbox drops the event and counts it), so
observability can never stall the data path. Counters are fed cumulative totals and
turned into increments here, so a dropped StepStats loses nothing.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from tinyserve.messages import (
    AdmissionRejected,
    RequestFailed,
    RequestFinished,
    Rerouted,
    StepStats,
)

log = logging.getLogger(__name__)

P = "tinyserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > max_len:
                return out
            out.append(base * m)
        base *= 10


class Metrics:
    def __init__(self, max_model_len: int, max_num_batched_tokens: int, inbox_size: int = 10_000):
        r = self.registry = CollectorRegistry()
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=inbox_size)
        tb = token_buckets(max_model_len)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS,
                              labelnames=["model"], registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=ITL_BUCKETS,
                              labelnames=["model"], registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS,
                              labelnames=["model"], registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduling",
                               buckets=TTFT_BUCKETS,
                              labelnames=["model"], registry=r)
        self.prompt_hist = Histogram(P + "request_prompt_tokens", "Prompt tokens per request",
                                     buckets=tb,
                              labelnames=["model"], registry=r)
        self.gen_hist = Histogram(P + "request_generation_tokens", "Output tokens per request",
                                  buckets=tb,
                              labelnames=["model"], registry=r)
        self.iter_tokens = Histogram(P + "iteration_tokens", "Tokens computed per step",
                                     buckets=token_buckets(max_num_batched_tokens),
                              labelnames=["model"], registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch",
                             labelnames=["model"], registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting to run",
                              labelnames=["model"], registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc",
                              "KV blocks referenced by live requests (0-1); cached but "
                              "unreferenced blocks count as free",
                              labelnames=["model"], registry=r)
        self.cache_info = Info(P + "cache_config", "KV cache configuration",
                              labelnames=["model"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests",
                                     labelnames=["model"], registry=r)
        self.gen_tokens = Counter(P + "generation_tokens", "Generated tokens",
                              labelnames=["model"], registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                              labelnames=["model"], registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits",
                                   "Prompt tokens served by the prefix cache",
                              labelnames=["model"], registry=r)
        self.prompt_computed = Counter(P + "prompt_tokens_computed",
                                       "Prompt tokens run through the model (prefix-cache hits "
                                       "excluded, recomputes after preemption included)",
                                       labelnames=["model"], registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted",
                              labelnames=["model"], registry=r)
        self.success = Counter(P + "request_success", "Finished requests",
                               ["model", "finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Requests answered with an error",
                              ["code"], registry=r)
        self.degradation = Gauge(P + "degradation_level",
                                 "0 normal; 1 shedding the lowest priority; 2 and capping "
                                 "degradable tenants; 3 only the highest priority",
                              labelnames=["model"], registry=r)
        self.slo_limit = Gauge(P + "slo_limit", "Requests the SLO controller lets the server "
                               "hold (running + waiting); 0 without --slo-*",
                              labelnames=["model"], registry=r)
        self.goodput = Counter(P + "request_goodput", "Requests finished within the SLO "
                               "(TTFT and mean ITL under their targets)", ["model", "tenant"],
                               registry=r)
        self.rejections = Counter(P + "admission_rejections",
                                  "Requests turned away by admission, by model, tenant and "
                                  "reason: concurrency, tokens (per-minute bucket), capacity, "
                                  "degraded (shed by the ladder), unavailable (model down)",
                                  ["model", "tenant", "reason"], registry=r)
        self.fallbacks = Counter(P + "fallback_requests", "Degradable requests for a model served "
                                 "by its fallback, by reason: degraded (SLO ladder level 2+) or "
                                 "down (its steps fail)", ["model", "fallback", "tenant", "reason"],
                                 registry=r)
        self.dropped = Counter(P + "metrics_events_dropped", "Metric events dropped (full inbox)",
                               registry=r)
        self._totals: dict[tuple[str, str], int] = {}  # (model, counter) -> last total seen

    def set_cache_config(self, model: str, block_size: int, num_blocks: int) -> None:
        # num_gpu_blocks is vLLM's name (prefix-aware endpoint pickers read it); num_blocks ours
        self.cache_info.labels(model=model).info({"block_size": str(block_size),
                                                  "num_blocks": str(num_blocks),
                                                  "num_gpu_blocks": str(num_blocks)})

    def emit(self, event: StepStats | RequestFinished | RequestFailed | AdmissionRejected
             | Rerouted) -> None:
        try:
            self.inbox.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped.inc()

    async def run(self) -> None:
        while True:
            self._apply(await self.inbox.get())

    def flush(self) -> None:
        """Apply every queued event now (before a scrape, so it sees up-to-date values)."""
        while not self.inbox.empty():
            self._apply(self.inbox.get_nowait())

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)

    def _apply(self, ev) -> None:
        try:
            match ev:
                case StepStats():
                    m = ev.model
                    if ev.num_tokens:
                        self.iter_tokens.labels(m).observe(ev.num_tokens)
                    self.running.labels(m).set(ev.num_running)
                    self.waiting.labels(m).set(ev.num_waiting)
                    self.kv_usage.labels(m).set(ev.kv_usage)
                    self.slo_limit.labels(m).set(ev.slo_limit)
                    self.degradation.labels(m).set(ev.degradation_level)
                    self._advance(self.preemptions, m, "preemptions", ev.preemptions)
                    self._advance(self.prompt_computed, m, "prompt_tokens_computed",
                                  ev.prompt_tokens_computed)
                    self._advance(self.prefix_queries, m, "prefix_queries", ev.prefix_queries)
                    self._advance(self.prefix_hits, m, "prefix_hits", ev.prefix_hits)
                case RequestFinished():
                    m = ev.model
                    self.success.labels(m, ev.finish_reason).inc()
                    if ev.within_slo:
                        self.goodput.labels(m, ev.tenant).inc()
                    self.prompt_tokens.labels(m).inc(ev.prompt_tokens)
                    self.gen_tokens.labels(m).inc(ev.generation_tokens)
                    self.prompt_hist.labels(m).observe(ev.prompt_tokens)
                    self.gen_hist.labels(m).observe(ev.generation_tokens)
                    self.e2e.labels(m).observe(ev.e2e_seconds)
                    if ev.queue_seconds is not None:
                        self.queue.labels(m).observe(ev.queue_seconds)
                    if ev.ttft_seconds is not None:
                        self.ttft.labels(m).observe(ev.ttft_seconds)
                    itl = self.itl.labels(m)
                    for gap in ev.itl_seconds:
                        itl.observe(gap)
                case RequestFailed():
                    self.errors.labels(code=ev.code).inc()
                case AdmissionRejected():
                    self.rejections.labels(ev.model, ev.tenant, ev.reason).inc()
                case Rerouted():
                    self.fallbacks.labels(ev.model, ev.fallback, ev.tenant, ev.reason).inc()
                case _:
                    log.warning("metrics: unknown event %r", ev)
        except Exception:  # a bad event is logged; the actor keeps running
            log.exception("metrics: failed to apply %r", ev)

    def _advance(self, counter: Counter, model: str, key: str, total: int) -> None:
        last = self._totals.get((model, key), 0)
        if total > last:
            counter.labels(model).inc(total - last)
            self._totals[model, key] = total
