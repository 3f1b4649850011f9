"""The Grafana dashboard (deploy/grafana/tinyserve.json) against a live /metrics.

The in-process server (fake model, real ingress, admission, batchers, SLO controllers and
metrics) gets traffic that puts a sample in every series it exports - a prefix-cache hit, a
preemption, errors, a capacity refusal, a fallback, goodput for two tenants - and then every
query of the dashboard must name only sample names it exported, with only labels those
samples carry.
"""

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.inprocess import FakeRunner, InProcessServer
from tinyserve.config import TenantConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tinyserve.json"
DS_VAR = "${DS_PROMETHEUS}"
FIRM, DEG = "key-firm", "key-degradable"
TENANTS = (TenantConfig("firm", FIRM), TenantConfig("deg", DEG, degradable=True))

METRIC = re.compile(r"tinyserve:[A-Za-z0-9_]+")
SELECTOR = re.compile(r"(tinyserve:[A-Za-z0-9_]+)(?:\s*\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*,?')
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*(tinyserve:[A-Za-z0-9_]+)\s*,\s*(\w+)\s*\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# -- the checker -----------------------------------------------------------------------------
def _group_after(expr: str, start: int) -> str | None:
    """The balanced ( ... ) that starts at ``start`` (after spaces), or None."""
    i = start
    while i < len(expr) and expr[i].isspace():
        i += 1
    if i >= len(expr) or expr[i] != "(":
        return None
    depth = 0
    for j in range(i, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[i: j + 1]
    return None


def _has_label(name: str, label: str, exported: dict[str, set[str]]) -> bool:
    return label in exported.get(name, set()) or (label == "le" and name.endswith("_bucket"))


def problems(expr: str, exported: dict[str, set[str]], legend: str = "") -> list[str]:
    """What is wrong with one PromQL query, given the exported sample names -> label names."""
    out = []
    names = METRIC.findall(expr)
    if not names:
        out.append(f"names no tinyserve metric: {expr}")
    out += [f"{n} is not exported" for n in names if n not in exported]
    filtered = not expr.lstrip().startswith("label_values(")  # a variable's own query is not
    for m in SELECTOR.finditer(expr):
        name, body = m.group(1), m.group(2) or ""
        rest = body
        for matcher in MATCHER.finditer(body):
            label = matcher.group(1)
            if name in exported and not _has_label(name, label, exported):
                out.append(f"{name} has no label {label!r} (matcher)")
            rest = rest.replace(matcher.group(0), "", 1)
        if rest.strip():
            out.append(f"unparsed matcher {rest!r} in {name}")
        for label in ("model", "tenant") if filtered else ():
            if label in exported.get(name, ()) and f'{label}=~"${label}"' not in body:
                out.append(f"{name} is not filtered by ${label}")
    for m in GROUPING.finditer(expr):
        keyword, labels = m.group(1), [x.strip() for x in m.group(2).split(",") if x.strip()]
        if keyword not in ("by", "without"):
            out.append(f"{keyword}(...) is not checked: do not use it")
            continue
        group = _group_after(expr, m.end())
        if group is None:  # sum(...) by (x): write it sum by (x) (...) so it can be checked
            out.append(f"'{m.group(0)}' must come before its argument")
            continue
        for label in labels:
            for name in METRIC.findall(group):
                if name in exported and not _has_label(name, label, exported):
                    out.append(f"{name} has no label {label!r} ({keyword})")
    for name, label in LABEL_VALUES.findall(expr):
        if name in exported and label not in exported[name]:
            out.append(f"{name} has no label {label!r} (label_values)")
    for label in LEGEND.findall(legend):
        if not any(_has_label(n, label, exported) for n in names if n in exported):
            out.append(f"legend label {label!r} is on none of {names}")
    for m in re.finditer(r"\b(rate|irate|increase)\(", expr):
        group = _group_after(expr, m.end() - 1) or ""
        if not group.rstrip(")").rstrip().endswith("[$__rate_interval]"):
            out.append(f"{m.group(1)} without [$__rate_interval]: {group}")
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
        out.append(f"unbalanced brackets: {expr}")
    return out


def all_panels(panels: list[dict]):
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def queries(dashboard: dict):
    """(where, expr, legend) of every panel target and every query variable."""
    for p in all_panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield f"panel {p['id']} {p['title']!r} {t.get('refId')}", t["expr"], t.get(
                "legendFormat", "")
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            yield f"variable {v['name']}", q["query"] if isinstance(q, dict) else q, ""


# -- the live server -------------------------------------------------------------------------
async def _traffic(srv: InProcessServer) -> str:
    def body(prompt, max_tokens=4, model="a"):
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

    async with aiohttp.ClientSession() as s:
        async def post(payload, key=FIRM):
            data = payload if isinstance(payload, str) else json.dumps(payload)
            async with s.post(srv.url + "/v1/completions", data=data, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
                return r.status, r.headers.get("X-Tinyserve-Model")

        shared = [1] + list(range(300, 339))  # two full 16-token blocks: a prefix-cache hit
        assert (await post(body(shared)))[0] == 200
        assert (await post(body(shared)))[0] == 200
        assert (await post(body([1, 5, 9], model="b"), DEG))[0] == 200
        # Two requests that outgrow the 8-block KV pool together: one is preempted.
        long = [body([1] + [(7 * i + j) % 250 + 3 for j in range(39)], 80) for i in range(2)]
        assert [r[0] for r in await asyncio.gather(*(post(b) for b in long))] == [200, 200]
        assert (await post("{not json"))[0] == 400
        assert (await post(body([1, 5], model="nope")))[0] == 404
        # a held full (capacity 2): the degradable tenant spills to b, the other gets 429.
        srv.runners["a"].hang = hold = threading.Event()
        held = [asyncio.ensure_future(post(body([1, 7 + i]))) for i in range(2)]
        lane = srv.server.admission.lanes["a"]
        deadline = time.monotonic() + 10
        while lane.in_system() < 2:
            assert time.monotonic() < deadline, "a never filled up"
            await asyncio.sleep(0.01)
        spilled = asyncio.ensure_future(post(body([1, 9]), DEG))
        assert (await post(body([1, 9])))[0] == 429
        hold.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
        assert await spilled == (200, "b")
        async with s.get(srv.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Exported sample name -> its label names, from a live /metrics after the traffic."""
    srv = InProcessServer(models={"a": FakeRunner(step_seconds=0.002), "b": FakeRunner()},
                          tenants=TENANTS, fallbacks=(("a", "b"),), slo_ttft_ms=60_000,
                          max_num_seqs=2, max_waiting=0, num_kv_blocks=8, max_model_len=128)
    try:
        text = asyncio.run(_traffic(srv))
    finally:
        srv.stop()
    out: dict[str, set[str]] = {}
    empty = []
    for family in text_string_to_metric_families(text):
        if not family.samples:
            empty.append(family.name)
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    assert not empty, f"the traffic left these without a sample: {empty}"
    # A mixture of experts' series (the fake model has none): from the metrics actor itself,
    # fed two steps' expert counters
    from tinyserve.actors.metrics import Metrics
    from tinyserve.messages import StepStats

    moe = Metrics(64, 64, moe=True)
    for load in ((0, 0), (5, 1)):
        moe.emit(StepStats(num_tokens=1, num_running=1, num_waiting=0, kv_usage=0.0,
                           preemptions=0, prompt_tokens_computed=0, prefix_queries=0,
                           prefix_hits=0, model="a", expert_load=((3, load),)))
    for family in text_string_to_metric_families(moe.render().decode()):
        if family.name.startswith("tinyserve:moe_"):
            assert family.samples, family.name
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    for name in ("num_preemptions_total", "prefix_cache_hits_total", "request_goodput_total",
                 "admission_rejections_total", "fallback_requests_total", "cache_config_info",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket"):
        assert f"tinyserve:{name}" in out, name
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# -- the tests -------------------------------------------------------------------------------
def test_every_query_names_only_exported_metrics_and_their_labels(dashboard, exported):
    found = [f"{where}: {p}" for where, expr, legend in queries(dashboard)
             for p in problems(expr, exported, legend)]
    assert not found, "\n".join(found)
    used = {n for _, expr, _ in queries(dashboard) for n in METRIC.findall(expr)}
    # Every family the server exports is on the dashboard somewhere.
    families = {re.sub(r"_(bucket|sum|count|total|created|info)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count|total|info)$", "", n) for n in used}
    assert families <= shown, sorted(families - shown)


def test_the_checker_flags_what_it_should(exported):
    sel = '{model=~"$model"}'
    bad = [
        "rate(tinyserve:no_such_metric_total[$__rate_interval])",
        f"sum by (model) (rate(tinyserve:num_preemptions{sel}[$__rate_interval]))",  # no _total
        f"histogram_quantile(0.5, sum by (le, model) (rate(tinyserve:num_preemptions_total_bucket"
        f"{sel}[$__rate_interval])))",
        f"sum by (le) (tinyserve:num_requests_running{sel})",  # le on a gauge
        f"sum by (tenant) (rate(tinyserve:num_preemptions_total{sel}[$__rate_interval]))",
        'sum by (code) (rate(tinyserve:request_errors_total{model=~"$model"}[$__rate_interval]))',
        "sum(rate(tinyserve:request_errors_total[$__rate_interval])) by (model)",
        "tinyserve:num_requests_running",  # not filtered by $model
        f"rate(tinyserve:prompt_tokens_total{sel}[5m])",
        "label_values(tinyserve:num_requests_running, tenant)",
    ]
    for expr in bad:
        assert problems(expr, exported), expr
    assert problems(f"sum by (model) (tinyserve:num_requests_running{sel})", exported,
                    "{{tenant}}")
    good = (f"histogram_quantile(0.99, sum by (le, model) (rate("
            f"tinyserve:time_to_first_token_seconds_bucket{sel}[$__rate_interval])))")
    assert problems(good, exported, "P99 {{model}}") == []


def test_variables_and_datasources(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name, metric in (("model", "tinyserve:num_requests_running"),
                         ("tenant", "tinyserve:request_goodput_total")):
        v = variables[name]
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert q == f"label_values({metric}, {name})"
        assert v["multi"] and v["includeAll"] and v["datasource"]["uid"] == DS_VAR
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = list(all_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Latency", "Throughput", "KV cache", "Reliability", "Tenants",
                    "Request phases and parameters"]
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": DS_VAR}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]


def test_the_issue_topics_each_have_a_panel(dashboard):
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
             for p in all_panels(dashboard["panels"])}

    def panel_with(*needles):
        return [title for title, e in exprs.items() if all(n in e for n in needles)]

    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            assert panel_with(f"histogram_quantile({q}, sum by (le, model) (rate("
                              f"tinyserve:{hist}_bucket"), (hist, q)
    for needles in (["tinyserve:prompt_tokens_total", "tinyserve:generation_tokens_total"],
                    ["tinyserve:num_requests_running"], ["tinyserve:num_requests_waiting"],
                    ["tinyserve:kv_cache_usage_perc"],
                    ["tinyserve:prefix_cache_hits_total", "/",
                     "tinyserve:prefix_cache_queries_total"],
                    ["tinyserve:num_preemptions_total"],
                    ["by (code)", "tinyserve:request_errors_total"],
                    ["tinyserve:degradation_level", "tinyserve:slo_limit"],
                    ["by (model, tenant)", "tinyserve:request_goodput_total"],
                    ["tenant, reason", "tinyserve:admission_rejections_total"],
                    ["tinyserve:fallback_requests_total"],
                    ["tinyserve:request_queue_time_seconds_bucket"],
                    ["tinyserve:iteration_tokens_total_bucket"],
                    ["tinyserve:request_prefill_time_seconds_bucket",
                     "tinyserve:request_decode_time_seconds_bucket"],
                    ["tinyserve:request_params_n_bucket"],
                    ["num_gpu_blocks", "block_size", "tinyserve:cache_config_info"]):
        assert panel_with(*needles), needles
