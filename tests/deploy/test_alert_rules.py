"""Prometheus rules in deploy/prometheus: promtool accepts them and their unit tests pass, every
metric they read is one tinyserve exports, and every alert has its severity, annotations and
runbook link.

promtool comes from Debian's ``prometheus`` package (CI installs it); without it these tests
fail rather than skip, so the rules cannot rot unchecked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULE_FILES = ("alerts.yml", "recording.yml")
TEST_FILE = "alerts_test.yml"
SEVERITIES = {"page", "ticket"}

# What the server exports (tinyserve/actors/metrics.py), by kind, without the prefix.
P = "tinyserve:"
HISTOGRAMS = {"time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_inference_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "request_params_n",
              "request_params_max_tokens", "iteration_tokens_total"}
GAUGES = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "degradation_level", "slo_limit"}
LORA_GAUGES = {"lora_requests_info"}  # only where a model serves LoRA adapters
MOE_GAUGES = {"moe_expert_load_imbalance"}  # only where a model has experts
INFOS = {"cache_config"}  # exported as cache_config_info
COUNTERS = {"prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "prompt_tokens_computed", "num_preemptions", "request_success", "request_errors",
            "request_goodput", "admission_rejections", "fallback_requests",
            "metrics_events_dropped", "api_requests",
            "constraint_failures", "request_faults", "failed_steps"}  # exported with _total
LORA_COUNTERS = {"lora_requests", "lora_loads"}
SPEC_COUNTERS = {"spec_decode_num_drafts", "spec_decode_num_draft_tokens",  # with speculation
                 "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"}

METRIC_TOKEN = re.compile(r"tinyserve:[a-zA-Z0-9_:]+")


def exported_names() -> set[str]:
    """Every series name the server can expose: histogram suffixes only on histograms,
    _total only on counters, _info only on the info."""
    names = {P + g for g in GAUGES | LORA_GAUGES | MOE_GAUGES}
    names |= {P + h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    names |= {P + c + "_total" for c in COUNTERS | LORA_COUNTERS | SPEC_COUNTERS}
    names |= {P + i + "_info" for i in INFOS}
    return names


def unknown_metrics(promql: str) -> set[str]:
    return set(METRIC_TOKEN.findall(promql)) - exported_names()


def anchor(alert: str) -> str:
    """TinyserveKVCacheFull -> tinyserve-kv-cache-full."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", alert).lower()


def load(name: str) -> dict:
    return yaml.safe_load((RULES_DIR / name).read_text())


def rules(name: str) -> list[dict]:
    return [r for g in load(name)["groups"] for r in g["rules"]]


def all_rules() -> list[dict]:
    return [r for f in RULE_FILES for r in rules(f)]


def alerts() -> list[dict]:
    return [r for r in all_rules() if "alert" in r]


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package "
                    "(apt-get install prometheus) to check deploy/prometheus")
    return path


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_check_rules(promtool: str, name: str) -> None:
    out = run([promtool, "check", "rules", name])
    assert out.returncode == 0, f"promtool check rules {name} failed:\n{out.stdout}{out.stderr}"
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests(promtool: str) -> None:
    out = run([promtool, "test", "rules", TEST_FILE])
    assert out.returncode == 0, (f"promtool test rules {TEST_FILE} failed:\n"
                                 f"{out.stdout}{out.stderr}")
    assert "SUCCESS" in out.stdout


def test_unit_tests_load_every_rule_file() -> None:
    assert sorted(load(TEST_FILE)["rule_files"]) == sorted(RULE_FILES)
    on_disk = {p.name for p in RULES_DIR.glob("*.yml")} - {TEST_FILE}
    assert on_disk == set(RULE_FILES), "a rules file is neither checked nor unit-tested"


def test_every_alert_fires_in_a_unit_test() -> None:
    tests = load(TEST_FILE)["tests"]
    fired = {t["alertname"] for tc in tests for t in tc.get("alert_rule_test", [])
             if t.get("exp_alerts")}
    missing = {a["alert"] for a in alerts()} - fired
    assert not missing, f"alerts no unit test makes fire: {sorted(missing)}"
    recorded = {r["record"] for r in all_rules() if "record" in r}
    exprs = " ".join(t["expr"] for tc in tests for t in tc.get("promql_expr_test", []))
    regexes = re.findall(r'__name__=~"([^"]+)"', exprs)
    untested = {r for r in recorded
                if not re.search(re.escape(r) + r"\b", exprs)
                and not any(re.fullmatch(rx, r) for rx in regexes)}
    assert not untested, f"recording rules no promql_expr_test reads: {sorted(untested)}"


def test_alerts_have_severity_annotations_and_runbook() -> None:
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert len(names) >= 10
    for a in alerts():
        name = a["alert"]
        assert re.fullmatch(r"Tinyserve[A-Za-z]+", name), name
        assert a.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        ann = a.get("annotations", {})
        for key in ("summary", "description"):
            assert ann.get(key, "").strip(), f"{name}: no {key}"
        assert ann.get("runbook_url") == f"docs/operations.md#{anchor(name)}", name
    assert {a["labels"]["severity"] for a in alerts()} == SEVERITIES


def test_exprs_use_only_exported_metrics() -> None:
    exprs = [r["expr"] for r in all_rules()]
    tests = load(TEST_FILE)["tests"]
    exprs += [s["series"] for tc in tests for s in tc.get("input_series", [])]
    exprs += [t["expr"] for tc in tests for t in tc.get("promql_expr_test", [])]
    used = {m for e in exprs for m in METRIC_TOKEN.findall(e)}
    assert len(used) >= 8, used  # the parse finds the metrics at all
    unknown = {m for e in exprs for m in unknown_metrics(e)}
    assert not unknown, f"not exported by tinyserve: {sorted(unknown)}"


@pytest.mark.parametrize("expr", [
    "rate(tinyserve:num_preemptions[5m])",  # counter without _total
    "tinyserve:kv_cache_usage_perc_total",  # _total on a gauge
    "tinyserve:kv_cache_usage_perc_bucket",  # histogram suffix on a gauge
    "rate(tinyserve:request_success_count[5m])",  # histogram suffix on a counter
    "tinyserve:time_to_first_token_seconds > 1",  # bare histogram name
    "rate(tinyserve:time_to_first_token_seconds_total[5m])",
    "tinyserve:cache_config",  # info without _info
    "tinyserve:request_latency_seconds_bucket",  # no such metric
    "job:x / tinyserve:request_errors_total:rate5m",
])
def test_metric_check_rejects(expr: str) -> None:
    assert unknown_metrics(expr), expr


def test_metric_check_accepts() -> None:
    ok = ('histogram_quantile(0.95, sum by (le, model) '
          '(rate(tinyserve:time_to_first_token_seconds_bucket[5m]))) '
          '+ tinyserve:kv_cache_usage_perc + rate(tinyserve:request_errors_total{code=~"5.."}[1m]) '
          '+ tinyserve:cache_config_info + tinyserve:iteration_tokens_total_sum')
    assert not unknown_metrics(ok)


def test_exported_list_matches_the_server() -> None:
    """The lists above are the server's registry, so a renamed metric fails here first."""
    from tinyserve.actors.metrics import Metrics

    kinds = {"histogram": HISTOGRAMS, "gauge": GAUGES, "counter": COUNTERS, "info": INFOS}
    expected = {(P + n, kind) for kind, names in kinds.items() for n in names}
    got = {(f.name, f.type) for f in Metrics(64, 64).registry.collect()}
    assert got == expected
    lora = {(P + n, "gauge") for n in LORA_GAUGES} | {(P + n, "counter") for n in LORA_COUNTERS}
    got = {(f.name, f.type) for f in Metrics(64, 64, lora=True).registry.collect()}
    assert got == expected | lora
    spec = {(P + n, "counter") for n in SPEC_COUNTERS}
    got = {(f.name, f.type) for f in Metrics(64, 64, speculation=True).registry.collect()}
    assert got == expected | spec
    moe = {(P + n, "gauge") for n in MOE_GAUGES}
    got = {(f.name, f.type) for f in Metrics(64, 64, moe=True).registry.collect()}
    assert got == expected | moe


def test_anchor() -> None:
    assert anchor("TinyserveKVCacheFull") == "tinyserve-kv-cache-full"
    assert anchor("TinyserveTTFTOverSLO") == "tinyserve-ttft-over-slo"
    assert anchor("TinyserveErrorBudgetFastBurn") == "tinyserve-error-budget-fast-burn"
