"""Metrics actor: owns the Prometheus registry; other actors send it events.

Names, types, help and buckets follow vLLM v1's (vllm/v1/metrics/loggers.py) under the
namespace ``tinyserve:``, or ``vllm:`` itself (``--metrics-namespace vllm``) so dashboards and
routers made for vLLM read tinyserve unchanged. Every series about a model's work carries its
name twice: as ``model`` (ours) and ``model_name`` (vLLM's). Not exported: vLLM's
request_max_num_generation_tokens (needs the API request's choices together; each finishes
alone here), its LoRA, spec-decode, sleep-state and multimodal series, and its ``engine`` label.
Events are sent with ``emit`` (never blocks: a full inbox drops the event and counts it), so
observability can never stall the data path. Counters are fed cumulative totals and
turned into increments here, so a dropped StepStats loses nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from tinyserve.actors.expert_load import EXPERT_WINDOW_S, ExpertLoadWindow
from tinyserve.config import METRICS_NAMESPACES
from tinyserve.messages import (
    AdmissionRejected,
    ApiAnswered,
    ConstraintFailed,
    RequestFailed,
    RequestFault,
    RequestFinished,
    Rerouted,
    StepFailed,
    StepStats,
)

log = logging.getLogger(__name__)

MODEL = ("model", "model_name")  # ours and vLLM's label for the served model: the same value
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > max_len:
                return out
            out.append(base * m)
        base *= 10


def iteration_buckets(max_tokens: int) -> list[int]:
    """vLLM's 1, 8, 16, ... 16384, doubled on up to a larger step budget."""
    out = [1] + [2**k for k in range(3, 15)]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


class Metrics:
    def __init__(self, max_model_len: int, max_num_batched_tokens: int, inbox_size: int = 10_000,
                 namespace: str = "tinyserve", lora: bool = False, speculation: bool = False,
                 moe: bool = False):
        if namespace not in METRICS_NAMESPACES:
            raise ValueError(f"metrics_namespace must be one of {', '.join(METRICS_NAMESPACES)}, "
                             f"got {namespace!r}")
        self.namespace = namespace
        self.registry = CollectorRegistry()
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=inbox_size)
        self._request_series(token_buckets(max_model_len))
        self._step_series(iteration_buckets(max_num_batched_tokens))
        self._feature_series(lora, speculation, moe)
        self._admission_series()
        self._totals: dict[tuple[str, str], int] = {}  # (model, counter) -> last total seen

    def _series(self, cls, name: str, doc: str, labels: list[str], **kw):
        return cls(f"{self.namespace}:{name}", doc, labels, registry=self.registry, **kw)

    def _per_model(self, cls, name: str, doc: str, *labels: str, **kw):
        """A series about one model's work: labels model and model_name, then ``labels``."""
        return self._series(cls, name, doc, [*MODEL, *labels], **kw)

    def _request_series(self, tb: list[int]) -> None:
        """Observed once a request finishes (RequestFinished)."""
        per_model, H, C = self._per_model, Histogram, Counter
        self.ttft = per_model(H, "time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS)
        self.itl = per_model(H, "inter_token_latency_seconds", "Time between output tokens",
                             buckets=ITL_BUCKETS)
        self.tpot = per_model(H, "request_time_per_output_token_seconds", "Mean time per output "
                              "token of a request (first to last token / tokens after the first)",
                              buckets=ITL_BUCKETS)
        self.e2e = per_model(H, "e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS)
        self.queue = per_model(H, "request_queue_time_seconds", "Arrival to first scheduling",
                               buckets=TTFT_BUCKETS)
        self.inference = per_model(H, "request_inference_time_seconds",
                                   "First scheduling to last token (running phase)",
                                   buckets=E2E_BUCKETS)
        self.prefill = per_model(H, "request_prefill_time_seconds",
                                 "First scheduling to first token (prefill phase)",
                                 buckets=E2E_BUCKETS)
        self.decode = per_model(H, "request_decode_time_seconds",
                                "First token to last token (decode phase)", buckets=E2E_BUCKETS)
        self.prompt_hist = per_model(H, "request_prompt_tokens", "Prompt tokens per request",
                                     buckets=tb)
        self.gen_hist = per_model(H, "request_generation_tokens", "Output tokens per request",
                                  buckets=tb)
        self.max_tokens = per_model(H, "request_params_max_tokens",
                                    "The max_tokens request parameter", buckets=tb)
        self.n = per_model(H, "request_params_n", "The n request parameter (once per API "
                           "request)", buckets=N_BUCKETS)
        self.prompt_tokens = per_model(C, "prompt_tokens", "Prompt tokens of finished requests")
        self.gen_tokens = per_model(C, "generation_tokens", "Generated tokens")
        self.success = per_model(C, "request_success", "Finished requests", "finished_reason")
        self.goodput = per_model(C, "request_goodput", "Requests finished within the SLO "
                                 "(TTFT and mean ITL under their targets)", "tenant")

    def _step_series(self, iteration_buckets: list[int]) -> None:
        """Set after each step (StepStats)."""
        per_model, H, G, C = self._per_model, Histogram, Gauge, Counter
        # vLLM v1's count, not the tokens the step computed (prompt_tokens_computed is that):
        # its test expects requests x (prompt + max_tokens) for uncached and cached prompts
        self.iter_tokens = per_model(H, "iteration_tokens_total", "Tokens per engine step, as "
                                     "vLLM counts them: the whole prompt (prefix-cache hits "
                                     "included) of each request that got its first token in "
                                     "the step, plus the tokens the step generated; steps that "
                                     "generate none are not observed",
                                     buckets=iteration_buckets)
        self.running = per_model(G, "num_requests_running", "Requests in the running batch")
        self.waiting = per_model(G, "num_requests_waiting", "Requests waiting to run")
        self.kv_usage = per_model(G, "kv_cache_usage_perc",
                                  "KV blocks referenced by live requests (0-1); cached but "
                                  "unreferenced blocks count as free")
        self.prefix_queries = per_model(C, "prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = per_model(C, "prefix_cache_hits",
                                     "Prompt tokens served by the prefix cache")
        self.prompt_computed = per_model(C, "prompt_tokens_computed",
                                         "Prompt tokens run through the model (prefix-cache "
                                         "hits excluded, recomputes after preemption included)")
        self.preemptions = per_model(C, "num_preemptions", "Sequences preempted")
        self.degradation = per_model(G, "degradation_level",
                                     "0 normal; 1 shedding the lowest priority; 2 and capping "
                                     "degradable tenants; 3 only the highest priority")
        self.slo_limit = per_model(G, "slo_limit", "Requests the SLO controller lets the server "
                                   "hold (running + waiting); 0 without --slo-*")

    def _feature_series(self, lora: bool, speculation: bool, moe: bool) -> None:
        """Speculation's, LoRA's and the experts' series (only where a model has them: no
        empty families), and vLLM's deprecated names under vllm:."""
        per_model, H, G, C = self._per_model, Histogram, Gauge, Counter
        self.moe_imbalance = None if not moe else per_model(
            G, "moe_expert_load_imbalance", "Mixture-of-experts models: per sparse layer, the "
            f"busiest expert's tokens over the mean expert's, over the last {EXPERT_WINDOW_S:g} "
            "s (1: even; the number of experts / top k at worst)", "layer")
        self._expert_windows: dict[str, ExpertLoadWindow] = {}
        # Speculative decoding (only where configured), vLLM's names
        self.spec = None
        if speculation:
            self.spec = (
                per_model(C, "spec_decode_num_drafts", "Verify steps (a speculating sequence's "
                          "drafts checked in one forward pass)"),
                per_model(C, "spec_decode_num_draft_tokens", "Draft tokens proposed"),
                per_model(C, "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
                per_model(C, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                          "accepted, by their position in the draft", "position"))
        # LoRA (only where a model serves adapters: no empty families otherwise). vLLM's
        # lora_requests_info: one sample whose labels list the adapters running and waiting
        self.lora_info = self.lora_requests = self.lora_loads = None
        if lora:
            self.lora_info = self._series(Gauge, "lora_requests_info",
                                          "Running stats on LoRA requests",
                                          ["max_lora", "waiting_lora_adapters",
                                           "running_lora_adapters"])
            self.lora_requests = per_model(C, "lora_requests", "Requests finished, by the "
                                           "LoRA adapter they ran with", "lora_name")
            self.lora_loads = per_model(C, "lora_loads", "LoRA adapters copied into a device "
                                        "slot (the first load and every swap after)")
        # vLLM's deprecated names, for readers of older vLLM (endpoint pickers before v1.3 read
        # gpu_cache_usage_perc): only under vllm:, where nothing else would show them
        self.aliases = self.namespace == "vllm"
        if self.aliases:
            self.tpot_alias = per_model(H, "time_per_output_token_seconds", "Time between "
                                        "output tokens (DEPRECATED in vLLM: use "
                                        "inter_token_latency_seconds)", buckets=ITL_BUCKETS)
            self.kv_usage_alias = per_model(G, "gpu_cache_usage_perc", "KV-cache usage (0-1); "
                                            "DEPRECATED in vLLM: use kv_cache_usage_perc")

    def _admission_series(self) -> None:
        """Admission's, the API's and the server's."""
        per_model, C = self._per_model, Counter
        self.cache_info = per_model(Info, "cache_config", "KV cache configuration")
        self.rejections = per_model(C, "admission_rejections",
                                    "Requests turned away by admission, by model, tenant and "
                                    "reason: concurrency, tokens (per-minute bucket), capacity, "
                                    "degraded (shed by the ladder), unavailable (model down)",
                                    "tenant", "reason")
        self.fallbacks = per_model(C, "fallback_requests", "Degradable requests for a model "
                                   "served by its fallback, by reason: degraded (SLO ladder "
                                   "level 2+) or down (its steps fail)", "fallback", "tenant",
                                   "reason")
        self.errors = self._series(C, "request_errors", "Requests answered with an error",
                                   ["code"])
        self.api_requests = self._series(C, "api_requests", "API requests answered, by route "
                                         "(its path template) and HTTP status (499: the client "
                                         "left first)", ["endpoint", "code"])
        self.constraint_failures = per_model(
            C, "constraint_failures", "Requests ended with an error mid-generation because "
            "their constraints could not go on: reason grammar (past a matcher limit), dead_end "
            "(the grammar allows no token), nothing_allowed (grammar, logit_bias bans and "
            "min_tokens leave no token) - all a 400 - or grammar_crash (the matcher raised: a "
            "500)", "reason")
        self.failed_steps = per_model(
            C, "failed_steps", "Steps that raised with no request to blame (each request in "
            "them answered 500; --max-failed-steps in a row and /health answers 503)")
        self.request_faults = per_model(
            C, "request_faults", "Requests ended by a fault of their own while the rest of "
            "their step went on: reason adapter (its LoRA adapter could not be read: a 500), "
            "non_finite (its logits were NaN or infinite: a 500), invalid (its inputs made the "
            "step raise; the step ran again without it: a 400)", "reason")
        self.dropped = self._series(C, "metrics_events_dropped",
                                    "Metric events dropped (full inbox)", [])

    def set_cache_config(self, model: str, block_size: int, num_blocks: int,
                         cache_dtype: str = "auto") -> None:
        # num_gpu_blocks and cache_dtype are vLLM's names (prefix-aware endpoint pickers read
        # the first); num_blocks ours
        self.cache_info.labels(model, model).info({"block_size": str(block_size),
                                                   "cache_dtype": cache_dtype,
                                                   "num_blocks": str(num_blocks),
                                                   "num_gpu_blocks": str(num_blocks)})
        # rare: exported at 0 until they happen
        for reason in ("grammar", "dead_end", "nothing_allowed", "grammar_crash"):
            self.constraint_failures.labels(model, model, reason)
        for reason in ("adapter", "non_finite", "invalid"):
            self.request_faults.labels(model, model, reason)
        self.failed_steps.labels(model, model)

    def emit(self, event: StepStats | RequestFinished | RequestFailed | AdmissionRejected
             | Rerouted | ApiAnswered | ConstraintFailed | RequestFault
             | StepFailed) -> None:
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
                    self._step(ev)
                case RequestFinished():
                    self._finished(ev)
                case RequestFailed():
                    self.errors.labels(code=ev.code).inc()
                case ApiAnswered():
                    self.api_requests.labels(ev.endpoint, ev.code).inc()
                case AdmissionRejected():
                    self.rejections.labels(ev.model, ev.model, ev.tenant, ev.reason).inc()
                case ConstraintFailed():
                    self.constraint_failures.labels(ev.model, ev.model, ev.reason).inc()
                case RequestFault():
                    self.request_faults.labels(ev.model, ev.model, ev.reason).inc()
                case StepFailed():
                    self.failed_steps.labels(ev.model, ev.model).inc()
                case Rerouted():
                    self.fallbacks.labels(ev.model, ev.model, ev.fallback, ev.tenant,
                                          ev.reason).inc()
                case _:
                    log.warning("metrics: unknown event %r", ev)
        except Exception:  # a bad event is logged; the actor keeps running
            log.exception("metrics: failed to apply %r", ev)

    def _step(self, ev: StepStats) -> None:
        m = ev.model
        if ev.num_tokens:
            self.iter_tokens.labels(m, m).observe(ev.num_tokens)
        self.running.labels(m, m).set(ev.num_running)
        self.waiting.labels(m, m).set(ev.num_waiting)
        self.kv_usage.labels(m, m).set(ev.kv_usage)
        if self.aliases:
            self.kv_usage_alias.labels(m, m).set(ev.kv_usage)
        self.slo_limit.labels(m, m).set(ev.slo_limit)
        self.degradation.labels(m, m).set(ev.degradation_level)
        self._advance(self.preemptions, m, "preemptions", ev.preemptions)
        self._advance(self.prompt_computed, m, "prompt_tokens_computed", ev.prompt_tokens_computed)
        self._advance(self.prefix_queries, m, "prefix_queries", ev.prefix_queries)
        self._advance(self.prefix_hits, m, "prefix_hits", ev.prefix_hits)
        if ev.spec is not None and self.spec is not None:
            drafts, tokens, accepted, at = ev.spec
            c_drafts, c_tokens, c_accepted, c_pos = self.spec
            self._advance(c_drafts, m, "spec_drafts", drafts)
            self._advance(c_tokens, m, "spec_draft_tokens", tokens)
            self._advance(c_accepted, m, "spec_accepted", accepted)
            for pos, n in enumerate(at):
                key = f"spec_at_{pos}"
                last = self._totals.get((m, key), 0)
                if n > last:
                    c_pos.labels(m, m, str(pos)).inc(n - last)
                    self._totals[m, key] = n
        if ev.expert_load is not None and self.moe_imbalance is not None:
            window = self._expert_windows.setdefault(m, ExpertLoadWindow())
            for layer, ratio in window.add(time.monotonic(), ev.expert_load):
                self.moe_imbalance.labels(m, m, str(layer)).set(ratio)
        if ev.lora is not None and self.lora_info is not None:
            running, waiting, max_lora, loads = ev.lora
            self.lora_info.clear()  # one sample: the state now
            self.lora_info.labels(str(max_lora), ",".join(waiting), ",".join(running)).set(
                time.time())
            self._advance(self.lora_loads, m, "lora_loads", loads)

    def _finished(self, ev: RequestFinished) -> None:
        m = ev.model
        self.success.labels(m, m, ev.finish_reason).inc()
        if ev.adapter and self.lora_requests is not None:
            self.lora_requests.labels(m, m, ev.adapter).inc()
        if ev.within_slo:
            self.goodput.labels(m, m, ev.tenant).inc()
        self.prompt_tokens.labels(m, m).inc(ev.prompt_tokens)
        self.gen_tokens.labels(m, m).inc(ev.generation_tokens)
        self.prompt_hist.labels(m, m).observe(ev.prompt_tokens)
        self.gen_hist.labels(m, m).observe(ev.generation_tokens)
        if ev.max_tokens:
            self.max_tokens.labels(m, m).observe(ev.max_tokens)
        if ev.n:  # 0: not the API request's first choice (n is counted once per API request)
            self.n.labels(m, m).observe(ev.n)
        # Phases, as vLLM splits them: queue (arrival -> first scheduled), prefill (-> first
        # token), decode (-> last token); inference = prefill + decode. None: never reached.
        e2e, queue, ttft = ev.e2e_seconds, ev.queue_seconds, ev.ttft_seconds
        self.e2e.labels(m, m).observe(e2e)
        if queue is not None:
            self.queue.labels(m, m).observe(queue)
            self.inference.labels(m, m).observe(max(0.0, e2e - queue))
        if ttft is not None:
            self.ttft.labels(m, m).observe(ttft)
            decode = max(0.0, e2e - ttft)
            self.decode.labels(m, m).observe(decode)
            if ev.generation_tokens > 1:
                self.tpot.labels(m, m).observe(decode / (ev.generation_tokens - 1))
            if queue is not None:
                self.prefill.labels(m, m).observe(max(0.0, ttft - queue))
        if ev.itl_seconds:
            observe_many(self.itl.labels(m, m), ev.itl_seconds)
            if self.aliases:
                observe_many(self.tpot_alias.labels(m, m), ev.itl_seconds)

    def _advance(self, counter: Counter, model: str, key: str, total: int) -> None:
        last = self._totals.get((model, key), 0)
        if total > last:
            counter.labels(model, model).inc(total - last)
            self._totals[model, key] = total


def observe_many(hist, values: tuple[float, ...]) -> None:
    """``hist.observe(v)`` for each value, counted per bucket first: a request's inter-token
    gaps (one per token) cost one increment per bucket they land in, not a bucket walk and
    three locked increments per token. Through prometheus_client's Histogram internals
    (``_upper_bounds``, ``_buckets``, ``_sum``: per-bucket counts, made cumulative on
    collection); tests/actors/test_vllm_metrics.py checks it against ``observe``."""
    bounds = hist._upper_bounds
    counts = [0] * len(bounds)
    last = len(bounds)
    for v in values:
        i = bisect.bisect_left(bounds, v)
        if i < last:  # (NaN lands in no bucket, as with observe)
            counts[i] += 1
    for i, c in enumerate(counts):
        if c:
            hist._buckets[i].inc(c)
    hist._sum.inc(sum(values))
