"""vLLM's metric set: the series vLLM v1 exports exist here under its names, types and
buckets, with vLLM's ``model_name`` label beside our ``model``; ``--metrics-namespace vllm``
publishes every series as ``vllm:...``. Drives the Metrics actor directly with its events."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.actors.test_actors import Graph
from tinyserve.actors.lanes import RequestHandle
from tinyserve.actors.metrics import Metrics
from tinyserve.cli.flags import build_parser
from tinyserve.cli.main import main
from tinyserve.config import ServerConfig
from tinyserve.engine.loading.demo import write_tokenizer
from tinyserve.messages import RequestFinished, SamplingParams, StepStats, Submit
from tinyserve.text.tokenizer import Tokenizer

# vLLM v1's names (vllm/v1/metrics/loggers.py), by kind, without the namespace.
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_params_n", "request_params_max_tokens",
    "iteration_tokens_total"}
VLLM_GAUGES = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
VLLM_COUNTERS = {"prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits"}
# Older vLLM names, still read by some routers and dashboards: only under vllm:
VLLM_DEPRECATED = {"time_per_output_token_seconds": "histogram", "gpu_cache_usage_perc": "gauge"}


def step(model="m", **kw) -> StepStats:
    fields = dict(num_tokens=40, num_running=2, num_waiting=1, kv_usage=0.25, preemptions=1,
                  prompt_tokens_computed=30, prefix_queries=40, prefix_hits=10, model=model)
    return StepStats(**(fields | kw))


def finished(model="m", **kw) -> RequestFinished:
    fields = dict(finish_reason="length", tenant="t", model=model, within_slo=None,
                  prompt_tokens=10, generation_tokens=5, queue_seconds=0.5, ttft_seconds=2.0,
                  e2e_seconds=6.0, itl_seconds=(1.0, 1.0, 1.0, 1.0), max_tokens=5, n=1)
    return RequestFinished(**(fields | kw))


def scrape(metrics: Metrics, *events) -> dict:
    """{sample name: {frozenset(labels): value}} after the events."""
    out: dict = {}
    for family in text_string_to_metric_families(scrape_text(metrics, *events)):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def scrape_text(metrics: Metrics, *events) -> str:
    for ev in events:
        metrics.emit(ev)
    return metrics.render().decode()


def value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    (v,) = [v for k, v in samples[name].items() if want <= k] or [None]
    return v


def families(metrics: Metrics) -> dict[str, str]:
    return {f.name: f.type for f in metrics.registry.collect()}


def test_vllm_names_types_and_the_model_name_label():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64)
    metrics.set_cache_config("m", block_size=16, num_blocks=10)
    got = families(metrics)
    for names, kind in ((VLLM_HISTOGRAMS, "histogram"), (VLLM_GAUGES, "gauge"),
                        (VLLM_COUNTERS, "counter")):
        for name in names:
            assert got.get("tinyserve:" + name) == kind, name
    assert "tinyserve:iteration_tokens" not in got  # renamed to vLLM's iteration_tokens_total
    assert not {"tinyserve:" + n for n in VLLM_DEPRECATED} & set(got)
    samples = scrape(metrics, step(), finished())
    for name, series in samples.items():
        if name.endswith(("metrics_events_dropped_total", "metrics_events_dropped_created")):
            continue  # about the server, not a model
        for labels in series:
            assert dict(labels)["model"] == dict(labels)["model_name"] == "m", (name, labels)
    info = dict(next(iter(samples["tinyserve:cache_config_info"])))
    assert info["num_gpu_blocks"] == "10" and info["model_name"] == "m"


def test_new_series_values():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64)
    samples = scrape(metrics, step(), step(num_tokens=8), finished(),
                     finished(n=2, max_tokens=100, generation_tokens=1, queue_seconds=None,
                              itl_seconds=(), ttft_seconds=1.0, e2e_seconds=1.0))
    p = "tinyserve:"
    it = p + "iteration_tokens_total"
    assert value(samples, it + "_count", model="m") == 2
    assert value(samples, it + "_sum", model="m") == 48
    assert value(samples, it + "_bucket", le="8.0") == 1  # vLLM's buckets: 1, 8, 16, ...
    assert value(samples, it + "_bucket", le="64.0") == 2
    assert value(samples, p + "request_params_n_count") == 2
    assert value(samples, p + "request_params_n_sum") == 3
    assert value(samples, p + "request_params_n_bucket", le="1.0") == 1
    assert value(samples, p + "request_params_max_tokens_sum") == 105
    assert value(samples, p + "request_params_max_tokens_bucket", le="5.0") == 1
    # first request: queue 0.5, TTFT 2, e2e 6; the second never queued (None): no inference
    # or prefill observation, decode 0
    assert value(samples, p + "request_inference_time_seconds_count") == 1
    assert value(samples, p + "request_inference_time_seconds_sum") == 5.5
    assert value(samples, p + "request_prefill_time_seconds_count") == 1
    assert value(samples, p + "request_prefill_time_seconds_sum") == 1.5
    assert value(samples, p + "request_decode_time_seconds_count") == 2
    assert value(samples, p + "request_decode_time_seconds_sum") == 4.0
    # per request mean TPOT: 4 s over the 4 tokens after the first; one token: none
    assert value(samples, p + "request_time_per_output_token_seconds_count") == 1
    assert value(samples, p + "request_time_per_output_token_seconds_sum") == 1.0
    assert value(samples, p + "request_success_total", finished_reason="length") == 2
    assert value(samples, p + "prompt_tokens_total") == 20
    assert value(samples, p + "generation_tokens_total") == 6
    assert value(samples, p + "num_preemptions_total") == 1  # a cumulative total, seen twice
    assert value(samples, p + "prefix_cache_hits_total") == 10
    assert value(samples, p + "kv_cache_usage_perc") == 0.25


def test_n_zero_is_not_observed():
    """n is the API request's n on its first choice and 0 on the others: one observation."""
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64)
    samples = scrape(metrics, finished(n=3), finished(n=0), finished(n=0))
    assert value(samples, "tinyserve:request_params_n_count") == 1
    assert value(samples, "tinyserve:request_params_n_sum") == 3
    assert value(samples, "tinyserve:request_success_total") == 3  # every choice finished
    assert value(samples, "tinyserve:request_params_max_tokens_count") == 3


def test_missing_timings_are_skipped():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64)
    samples = scrape(metrics, finished(queue_seconds=None, ttft_seconds=None, itl_seconds=(),
                                       generation_tokens=0, finish_reason="abort"))
    p = "tinyserve:"
    assert value(samples, p + "e2e_request_latency_seconds_count") == 1
    for name in ("request_queue_time_seconds", "time_to_first_token_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert p + name + "_count" not in samples, name


def test_vllm_namespace_names_every_series_vllm():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64, namespace="vllm")
    metrics.set_cache_config("m", block_size=16, num_blocks=10)
    got = families(metrics)
    assert all(name.startswith("vllm:") for name in got), sorted(got)
    kinds = [(VLLM_HISTOGRAMS, "histogram"), (VLLM_GAUGES, "gauge"), (VLLM_COUNTERS, "counter")]
    for names, kind in kinds + [({n}, k) for n, k in VLLM_DEPRECATED.items()]:
        for name in names:
            assert got.get("vllm:" + name) == kind, name
    # the same families as under tinyserve:, plus the deprecated aliases
    ours = {n.removeprefix("tinyserve:") for n in families(Metrics(128, 64))}
    assert {n.removeprefix("vllm:") for n in got} == ours | set(VLLM_DEPRECATED)
    text = scrape_text(metrics, step(), finished())
    assert "tinyserve:" not in text
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line
             and not line.startswith("#")]
    assert names and all(n.startswith("vllm:") for n in names)
    for line in ('vllm:num_requests_waiting{model="m",model_name="m"} 1.0',
                 'vllm:kv_cache_usage_perc{model="m",model_name="m"} 0.25',
                 'vllm:gpu_cache_usage_perc{model="m",model_name="m"} 0.25',
                 'vllm:prompt_tokens_total{model="m",model_name="m"} 10.0',
                 'vllm:generation_tokens_total{model="m",model_name="m"} 5.0',
                 'vllm:num_preemptions_total{model="m",model_name="m"} 1.0',
                 'vllm:prefix_cache_queries_total{model="m",model_name="m"} 40.0',
                 'vllm:prefix_cache_hits_total{model="m",model_name="m"} 10.0',
                 'vllm:request_success_total{finished_reason="length",model="m",'
                 'model_name="m"} 1.0',
                 'vllm:time_per_output_token_seconds_count{model="m",model_name="m"} 4.0',
                 'vllm:inter_token_latency_seconds_count{model="m",model_name="m"} 4.0',
                 'vllm:iteration_tokens_total_count{model="m",model_name="m"} 1.0',
                 'vllm:cache_config_info{block_size="16",cache_dtype="auto",model="m",'
                 'model_name="m",num_blocks="10",num_gpu_blocks="10"} 1.0'):
        assert line in text, line


def test_bad_namespace():
    with pytest.raises(ValueError, match="metrics_namespace"):
        Metrics(64, 64, namespace="sglang")
    with pytest.raises(ValueError, match="metrics_namespace"):
        ServerConfig(metrics_namespace="VLLM")
    assert ServerConfig().metrics_namespace == "tinyserve"


def test_cli_flag(monkeypatch, capsys):
    assert build_parser().parse_args([]).metrics_namespace == "tinyserve"
    assert build_parser().parse_args(["--metrics-namespace", "vllm"]).metrics_namespace == "vllm"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--metrics-namespace", "prom"])
    assert e.value.code == 2
    assert "--metrics-namespace" in capsys.readouterr().err

    import tinyserve.server

    seen = []

    async def serve(cfg, models):  # main parses, then hands ServerConfig to the server
        seen.append(cfg)
        return 0

    monkeypatch.setattr(tinyserve.server, "serve", serve)
    assert main(["--metrics-namespace", "vllm"]) == 0
    assert seen[0].metrics_namespace == "vllm"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer(path)


def test_iteration_tokens_total_counts_as_vllm_does(tokenizer):
    """vLLM's test_metrics_counts: requests x (prompt + max_tokens) summed over requests x
    max_tokens steps, whatever the prefix cache served (each repeat of the prompt finds its
    first two blocks cached) and whatever the warm-up ran. Through the real batcher, with
    the actor tests' fake model."""
    prompt, max_tokens, requests = (256, *range(104, 112)), 4, 4  # 9 tokens: blocks of 4

    async def main():
        async with Graph(tokenizer) as g:
            warm = RequestHandle(99, asyncio.Queue(maxsize=16))  # the server's own warm-up
            g.batcher.inbox.put_nowait(Submit(
                request_id=99, prompt_token_ids=prompt, params=SamplingParams(max_tokens=2),
                arrival_time=time.monotonic(), handle=warm, internal=True))
            while g.batcher.num_requests:
                await asyncio.sleep(0.01)
            for i in range(requests):  # one after the other, as vLLM's test sends them
                _, outs = await g.request(i + 1, prompt, max_tokens)
                assert outs[-1].completion_tokens == max_tokens
            assert g.core.kv.prefix_hits >= 8 * (requests - 1)
            await asyncio.sleep(0.05)  # the last StepStats reaches the metrics actor
            return scrape(g.metrics)

    samples = asyncio.run(main())
    it = "tinyserve:iteration_tokens_total"
    assert value(samples, it + "_sum", model="m") == requests * (len(prompt) + max_tokens)
    assert value(samples, it + "_count", model="m") == requests * max_tokens


def test_observe_many_counts_as_observe_does():
    from prometheus_client import CollectorRegistry, Histogram

    from tinyserve.actors.metrics import observe_many
    values = (0.0, 1e-9, 0.001, 0.0049, 0.005, 0.0051, 0.02, 0.5, 3.0, 1e9, 7.5, 0.005)
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.005, 0.01, 0.1, 1.0, 5.0)
    a = Histogram("h", "x", registry=r1, buckets=buckets)
    b = Histogram("h", "x", registry=r2, buckets=buckets)
    for v in values:
        a.observe(v)
    observe_many(b, values)
    samples = [(s.name, s.labels, s.value) for m in r1.collect() for s in m.samples
               if not s.name.endswith("_created")]
    assert samples == [(s.name, s.labels, s.value) for m in r2.collect() for s in m.samples
                       if not s.name.endswith("_created")]


def test_expert_load_window_is_max_over_mean_since_the_window_began():
    import math

    from tinyserve.actors.expert_load import ExpertLoadWindow

    def add(t, load):  # NaN (an idle layer) as None, to compare
        return [(layer, None if math.isnan(r) else r) for layer, r in w.add(t, load)]

    w = ExpertLoadWindow(window_s=10.0)
    assert add(0.0, ((1, (5, 5, 5, 5)), (3, (0, 0, 0, 0)))) == [(1, None), (3, None)]  # baseline
    # layer 1: +8 on expert 0, +0 on the rest (max 8 over mean 2: 4 = E, the worst);
    # layer 3: +1 each (even: 1)
    assert add(1.0, ((1, (13, 5, 5, 5)), (3, (1, 1, 1, 1)))) == [(1, 4.0), (3, 1.0)]
    # 12 s on: the window starts at the snapshot of t = 1 (the newest at or before now - 10);
    # layer 3 routed nothing since: idle, NaN (never the last busy figure kept)
    assert add(12.0, ((1, (13, 9, 9, 5)), (3, (1, 1, 1, 1)))) == [(1, 2.0), (3, None)]
    # the counters restarted (a reloaded model): a new baseline, nothing to report yet
    assert add(13.0, ((1, (0, 0, 0, 0)),)) == [(1, None)]
    assert add(14.0, ((1, (3, 1, 0, 0)),)) == [(1, 3.0)]


def test_expert_load_imbalance_gauge_per_layer():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64, moe=True)
    samples = scrape(metrics, step(expert_load=((0, (0, 0, 0)), (2, (0, 0, 0)))),
                     step(expert_load=((0, (6, 0, 0)), (2, (2, 2, 2)))), step())
    name = "tinyserve:moe_expert_load_imbalance"
    assert value(samples, name, model="m", layer="0") == 3.0
    assert value(samples, name, model="m", layer="2") == 1.0
    assert len(samples[name]) == 2
