"""The Kubernetes manifests in deploy/k8s: valid for the cluster, consistent with the server.

Core kinds are validated with kubernetes-validate (strict: unknown fields fail) against one
pinned Kubernetes version; custom resources against small JSON schemas written here from their
CRDs (versions named at each schema). The cross-checks tie the manifests to this repository:
container flags come from the server's own argument parser, the tenants file is read with the
server's own loader, and every metric an autoscaler or the endpoint picker reads is one the
server exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from tinyserve.actors.metrics import Metrics
from tinyserve.cli.flags import build_parser
from tinyserve.cli.tenants import load_tenants

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes these manifests target (preStop sleep: >= 1.30)
FILES = sorted(K8S_DIR.rglob("*.yaml")) + sorted(K8S_DIR.rglob("*.yml"))

# What the server exports (README "Operating it"; checked against its registry below): the
# sample names a PromQL query or a scraper can use.
_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
               "e2e_request_latency_seconds", "request_queue_time_seconds",
               "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
               "request_time_per_output_token_seconds", "request_inference_time_seconds",
               "request_prefill_time_seconds", "request_decode_time_seconds",
               "request_params_n", "request_params_max_tokens")
_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
           "degradation_level", "slo_limit")
_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
             "prompt_tokens_computed", "num_preemptions", "request_success", "request_errors",
             "request_goodput", "admission_rejections", "fallback_requests",
             "metrics_events_dropped")
EXPORTED = frozenset(
    [f"tinyserve:{h}{s}" for h in _HISTOGRAMS for s in ("_bucket", "_sum", "_count")]
    + [f"tinyserve:{g}" for g in _GAUGES]
    + [f"tinyserve:{c}_total" for c in _COUNTERS]
    + ["tinyserve:cache_config_info"])
CACHE_INFO_LABELS = {"model", "model_name", "block_size", "cache_dtype", "num_blocks", "num_gpu_blocks"}
METRIC_RE = re.compile(r"tinyserve:[A-Za-z0-9_:]*")

# -- JSON schemas for the custom resources ----------------------------------------------------
STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
ARR = {"type": "array"}
STR_MAP = {"type": "object", "additionalProperties": STR}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
PROM_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                              r"(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
GW_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def obj(properties: dict, required: tuple[str, ...] = ()) -> dict:
    """A closed object: a field the CRD does not define is an error (as in kubectl's strict
    field validation)."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


LABEL_SELECTOR = obj({"matchLabels": STR_MAP, "matchExpressions": ARR})
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": STR, "namespace": STR, "labels": STR_MAP,
                           "annotations": STR_MAP}}


def resource(api_version: str, kind: str, spec: dict) -> dict:
    return obj({"apiVersion": {"const": api_version}, "kind": {"const": kind},
                "metadata": METADATA, "spec": spec},
               required=("apiVersion", "kind", "metadata", "spec"))


# PodMonitor: prometheus-operator v0.93.0, monitoring.coreos.com_podmonitors.yaml (v1).
POD_MONITOR = resource("monitoring.coreos.com/v1", "PodMonitor", obj({
    "attachMetadata": OBJ, "bodySizeLimit": STR, "convertClassicHistogramsToNHCB": BOOL,
    "fallbackScrapeProtocol": {"enum": ["PrometheusProto", "OpenMetricsText0.0.1",
                                        "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                                        "PrometheusText1.0.0"]},
    "jobLabel": STR, "keepDroppedTargets": INT, "labelLimit": INT, "labelNameLengthLimit": INT,
    "labelValueLengthLimit": INT, "namespaceSelector": OBJ, "nativeHistogramBucketLimit": INT,
    "nativeHistogramMinBucketFactor": {}, "podTargetLabels": {"type": "array", "items": STR},
    "sampleLimit": INT, "scrapeClass": STR, "scrapeClassicHistograms": BOOL,
    "scrapeNativeHistograms": BOOL, "scrapeProtocols": ARR, "selector": LABEL_SELECTOR,
    "selectorMechanism": {"enum": ["RelabelConfig", "RoleSelector"]}, "targetLimit": INT,
    "podMetricsEndpoints": {"type": "array", "items": obj({
        "authorization": OBJ, "basicAuth": OBJ, "bearerTokenSecret": OBJ, "enableHttp2": BOOL,
        "filterRunning": BOOL, "followRedirects": BOOL, "honorLabels": BOOL,
        "honorTimestamps": BOOL, "interval": PROM_DURATION, "metricRelabelings": ARR,
        "noProxy": STR, "oauth2": OBJ, "params": OBJ, "path": STR, "port": STR,
        "portNumber": PORT, "proxyConnectHeader": OBJ, "proxyFromEnvironment": BOOL,
        "proxyUrl": {"type": "string", "pattern": "^(http|https|socks5)://.+$"},
        "relabelings": ARR, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "scrapeTimeout": PROM_DURATION, "targetPort": {"type": ["integer", "string"]},
        "tlsConfig": OBJ, "trackTimestampsStaleness": BOOL})},
}, required=("selector",)))

# ScaledObject: KEDA v2.20.2, keda.sh_scaledobjects.yaml (v1alpha1). metricType is a plain
# string in the CRD; the enum is the HPA's target types, which KEDA passes on.
_HPA_BEHAVIOR = {"type": "object"}  # validated as part of the HPA by kubernetes-validate
SCALED_OBJECT = resource("keda.sh/v1alpha1", "ScaledObject", obj({
    "advanced": obj({
        "horizontalPodAutoscalerConfig": obj({"name": STR, "behavior": _HPA_BEHAVIOR}),
        "restoreToOriginalReplicaCount": BOOL, "scalingModifiers": OBJ}),
    "cooldownPeriod": {"type": "integer", "minimum": 0},
    "fallback": obj({"behavior": {"enum": ["static", "currentReplicas",
                                           "currentReplicasIfHigher", "currentReplicasIfLower",
                                           "scalingModifiers"]},
                     "failureThreshold": {"type": "integer", "minimum": 0},
                     "replicas": {"type": "integer", "minimum": 0}},
                    required=("failureThreshold", "replicas")),
    "idleReplicaCount": {"type": "integer", "minimum": 0},
    "initialCooldownPeriod": {"type": "integer", "minimum": 0},
    "maxReplicaCount": {"type": "integer", "minimum": 1},
    "minReplicaCount": {"type": "integer", "minimum": 0},
    "pollingInterval": {"type": "integer", "minimum": 1},
    "scaleTargetRef": obj({"apiVersion": STR, "envSourceContainerName": STR, "kind": STR,
                           "name": {"type": "string", "minLength": 1}}, required=("name",)),
    "triggers": {"type": "array", "minItems": 1, "items": obj({
        "authenticationRef": obj({"kind": {"enum": ["TriggerAuthentication",
                                                    "ClusterTriggerAuthentication"]},
                                  "name": STR}, required=("name",)),
        "metadata": STR_MAP,
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "name": STR, "type": {"type": "string", "minLength": 1}, "useCachedMetrics": BOOL,
    }, required=("metadata", "type"))},
}, required=("scaleTargetRef", "triggers")))
# The prometheus trigger's metadata keys (KEDA v2.20.2 pkg/scalers/prometheus_scaler.go).
_NUMBER = {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$"}
_TRUE_FALSE = {"enum": ["true", "false"]}
KEDA_PROMETHEUS_METADATA = obj({
    "serverAddress": {"type": "string", "pattern": "^https?://"}, "query": STR,
    "queryParameters": STR, "threshold": _NUMBER, "activationThreshold": _NUMBER,
    "namespace": STR, "customHeaders": STR, "ignoreNullValues": _TRUE_FALSE,
    "unsafeSsl": _TRUE_FALSE, "awsRegion": STR, "timeout": STR, "identityOwner": STR,
    "authModes": STR,
}, required=("serverAddress", "query", "threshold"))

# InferencePool: gateway-api-inference-extension v1.3.1,
# inference.networking.k8s.io_inferencepools.yaml (v1, the GA group).
_LABEL_VALUE = {"type": "string", "maxLength": 63,
                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
INFERENCE_POOL = resource("inference.networking.k8s.io/v1", "InferencePool", obj({
    "endpointPickerRef": obj({
        "failureMode": {"enum": ["FailOpen", "FailClose"]},
        "group": {"type": "string", "maxLength": 253},
        "kind": {"type": "string", "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": obj({"number": PORT}, required=("number",)),
    }, required=("name",)),
    "selector": obj({"matchLabels": {"type": "object", "minProperties": 1,
                                     "maxProperties": 64,
                                     "additionalProperties": _LABEL_VALUE}},
                    required=("matchLabels",)),
    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                    "items": obj({"number": PORT}, required=("number",))},
}, required=("endpointPickerRef", "selector", "targetPorts")))

# HTTPRoute: Gateway API v1.6.1 standard channel, gateway.networking.k8s.io_httproutes.yaml (v1).
_BACKEND_REF = obj({"filters": ARR, "group": STR, "kind": STR, "name": STR, "namespace": STR,
                    "port": PORT, "weight": {"type": "integer", "minimum": 0}},
                   required=("name",))
HTTP_ROUTE = resource("gateway.networking.k8s.io/v1", "HTTPRoute", obj({
    "hostnames": {"type": "array", "items": STR},
    "parentRefs": {"type": "array", "items": obj({
        "group": STR, "kind": STR, "name": STR, "namespace": STR, "port": PORT,
        "sectionName": STR}, required=("name",))},
    "rules": {"type": "array", "items": obj({
        "name": STR, "filters": ARR, "backendRefs": {"type": "array", "items": _BACKEND_REF},
        "matches": {"type": "array", "items": obj({
            "headers": ARR, "method": STR, "queryParams": ARR,
            "path": obj({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                         "value": {"type": "string", "maxLength": 1024}})})},
        "timeouts": obj({"request": GW_DURATION, "backendRequest": GW_DURATION}),
    })},
}))

CRD_SCHEMAS = {(s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
               for s in (POD_MONITOR, SCALED_OBJECT, INFERENCE_POOL, HTTP_ROUTE)}

# prometheus-adapter v0.12 config file (pkg/config/config.go: MetricsDiscoveryConfig).
_ADAPTER_RULE = obj({
    "seriesQuery": STR,
    "seriesFilters": {"type": "array", "items": obj({"is": STR, "isNot": STR})},
    "resources": obj({"template": STR, "namespaced": BOOL, "overrides": {
        "type": "object", "additionalProperties": obj({"group": STR, "resource": STR},
                                                      required=("resource",))}}),
    "name": obj({"matches": STR, "as": STR}),
    "metricsQuery": STR,
}, required=("seriesQuery", "resources", "name", "metricsQuery"))
ADAPTER_CONFIG = obj({"rules": {"type": "array", "items": _ADAPTER_RULE},
                      "externalRules": {"type": "array", "items": _ADAPTER_RULE},
                      "resourceRules": OBJ})

# The EPP's command-line flags at gateway-api-inference-extension v1.3.1
# (pkg/epp/server/options.go, plus controller-runtime's zap flags).
EPP_FLAGS = frozenset("""
    grpc-port ha-enable-leader-election pool-group pool-namespace pool-name endpoint-selector
    endpoint-target-ports disable-endpoint-subset-filter model-server-metrics-scheme
    model-server-metrics-path model-server-metrics-port
    model-server-metrics-https-insecure-skip-verify refresh-metrics-interval
    refresh-prometheus-metrics-interval metrics-staleness-threshold total-queued-requests-metric
    total-running-requests-metric kv-cache-usage-percentage-metric lora-info-metric
    cache-info-metric v tracing health-checking metrics-port grpc-health-port enable-pprof
    cert-path enable-cert-reload secure-serving metrics-endpoint-auth config-file config-text
    zap-devel zap-encoder zap-log-level zap-stacktrace-level zap-time-encoding
""".split())


# -- loading ----------------------------------------------------------------------------------
def _load(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, dict]]:
    return [(str(p.relative_to(K8S_DIR)), d) for p in FILES for d in _load(p)]


def _find(docs, kind: str, name: str | None = None, api_prefix: str = "") -> dict:
    found = [d for _, d in docs if d["kind"] == kind and d["apiVersion"].startswith(api_prefix)
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def server(docs) -> dict:
    return _find(docs, "Deployment", "tinyserve")


@pytest.fixture(scope="module")
def container(server) -> dict:
    (c,) = [c for c in server["spec"]["template"]["spec"]["containers"] if c["name"] == "tinyserve"]
    return c


@pytest.fixture(scope="module")
def server_args(container):
    """The container's arguments parsed by the server's own parser (so they are flags it has,
    with values it accepts)."""
    assert container["command"] == ["python", "-m", "tinyserve"]
    parser = build_parser()
    help_text = parser.format_help()
    for arg in container["args"]:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            # exact spelling: argparse would also accept an abbreviation
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), \
                f"{flag} is not in `python -m tinyserve --help`"
    try:
        return parser.parse_args(container["args"])
    except SystemExit:  # argparse already printed why
        pytest.fail(f"python -m tinyserve rejects the Deployment's args {container['args']}")


def _pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_port(container: dict, port: int | str) -> int:
    """A probe's / Service's port (number or name) as the container port number."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container["ports"]]
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def _volume(deployment: dict, name: str) -> dict:
    (v,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


def _prestop_sleep(container: dict) -> float:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] in ("sleep", "/bin/sleep") and len(cmd) == 2, cmd
    return float(cmd[1])


def _flag_values(args: list[str]) -> dict[str, str]:
    """Go-style flags (--name=value or --name value) to {name: value}."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("-"), f"stray argument {arg!r}"
        name, sep, value = arg.lstrip("-").partition("=")
        if not sep and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value, i = args[i + 1], i + 1
        assert name not in out, f"flag {name} given twice"
        out[name] = value
        i += 1
    return out


# -- parsing and schemas ----------------------------------------------------------------------
def test_manifest_files_exist():
    names = {str(p.relative_to(K8S_DIR)) for p in FILES}
    assert {"base/deployment.yaml", "base/service.yaml", "base/secret-tenants.yaml",
            "monitoring/podmonitor.yaml", "autoscaling-hpa/hpa.yaml",
            "autoscaling-hpa/prometheus-adapter-rules.yaml", "autoscaling-keda/scaledobject.yaml",
            "inference-gateway/inferencepool.yaml", "inference-gateway/epp.yaml"} <= names
    assert (K8S_DIR / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_every_document_parses(path):
    documents = _load(path)
    assert documents, f"{path} has no documents"
    for d in documents:
        assert isinstance(d, dict) and {"apiVersion", "kind", "metadata"} <= d.keys(), d


def test_pinned_kubernetes_schemas_are_shipped():
    # kubernetes-validate silently falls back to an older schema set for a version it lacks
    assert K8S_VERSION in all_versions()


def test_core_kinds_validate_strictly(docs):
    validated = set()
    for where, d in docs:
        if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{where}: {d['kind']}/{d['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{where}: no schema and no CRD schema here: {e.message}")
        validated.add(d["kind"])
    assert {"Deployment", "Service", "Secret", "ConfigMap", "HorizontalPodAutoscaler",
            "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding"} <= validated


def test_strict_validation_rejects_unknown_fields(server):
    broken = yaml.safe_load(yaml.safe_dump(server))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_custom_resources_match_their_crd_schemas(docs):
    seen = set()
    for where, d in docs:
        schema = CRD_SCHEMAS.get((d["apiVersion"], d["kind"]))
        if schema is None:
            continue
        try:
            jsonschema.validate(d, schema)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: {d['kind']}: {'.'.join(map(str, e.path))}: {e.message}")
        seen.add(d["kind"])
    assert seen == {"PodMonitor", "ScaledObject", "InferencePool", "HTTPRoute"}


@pytest.mark.parametrize("schema", [POD_MONITOR, SCALED_OBJECT, INFERENCE_POOL, HTTP_ROUTE],
                         ids=lambda s: s["properties"]["kind"]["const"])
def test_crd_schemas_reject_unknown_spec_fields(docs, schema):
    kind = schema["properties"]["kind"]["const"]
    (d,) = [d for _, d in docs if d["kind"] == kind]
    broken = yaml.safe_load(yaml.safe_dump(d))
    broken["spec"]["notAField"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


# -- the server Deployment ----------------------------------------------------------------------
def test_server_args_and_ports(server_args, container):
    assert server_args.host == "0.0.0.0"
    assert _container_port(container, "http") == server_args.port


def test_probes_hit_health_and_ready_on_the_server_port(server_args, container):
    live, ready, start = (container[k]["httpGet"] for k in
                          ("livenessProbe", "readinessProbe", "startupProbe"))
    assert live["path"] == "/health"
    assert ready["path"] == "/ready"
    assert start["path"] in ("/ready", "/health")
    for probe in (live, ready, start):
        assert _container_port(container, probe["port"]) == server_args.port
    startup = container["startupProbe"]
    # loading + warm-up takes minutes: the startup probe must allow at least 10 of them
    assert startup["failureThreshold"] * startup.get("periodSeconds", 10) >= 600


def test_grace_period_covers_prestop_and_drain(server, server_args, container):
    grace = server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    sleep = _prestop_sleep(container)
    assert sleep > 0
    assert grace > server_args.drain_timeout + sleep


def test_gpu_security_and_volumes(server, server_args, container, docs):
    limits = container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 1
    pod = server["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"].get("runAsUser", 1) != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # the model directory is on a read-only PVC mount
    models = _volume(server, "models")
    assert models["persistentVolumeClaim"]["readOnly"] is True
    assert mounts["models"]["readOnly"] is True
    _find(docs, "PersistentVolumeClaim", models["persistentVolumeClaim"]["claimName"])
    for spec in server_args.model:
        directory = spec.split(",")[0].split("=")[-1]
        assert directory.startswith(mounts["models"]["mountPath"].rstrip("/") + "/"), directory


def test_tenants_secret_is_mounted_where_tenants_points(server, server_args, container, docs):
    volume = _volume(server, "tenants")["secret"]
    secret = _find(docs, "Secret", volume["secretName"])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tenants"]
    assert mount["readOnly"] is True
    (item,) = volume["items"]
    assert item["key"] in secret["stringData"]
    assert server_args.tenants == f"{mount['mountPath'].rstrip('/')}/{item['path']}"


def test_sample_tenants_file_loads(docs, tmp_path):
    secret = _find(docs, "Secret", "tinyserve-tenants")
    path = tmp_path / "tenants.toml"
    path.write_text(secret["stringData"]["tenants.toml"])
    tenants = load_tenants(str(path))
    assert len(tenants) >= 2
    assert any(t.admin for t in tenants)
    for t in tenants:
        assert "fake" in t.api_key, f"tenant {t.name}: sample keys must be obviously fake"


def test_service_selects_the_server_pods(server, container, docs):
    svc = _find(docs, "Service", "tinyserve")
    labels = _pod_labels(server)
    assert _selects(server["spec"]["selector"]["matchLabels"], labels)
    assert _selects(svc["spec"]["selector"], labels)
    assert svc["spec"]["type"] == "ClusterIP"
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == 8000
    assert _container_port(container, port["targetPort"]) == 8000


def test_podmonitor_scrapes_the_metrics_port(server, container, docs):
    pm = _find(docs, "PodMonitor", "tinyserve")
    assert _selects(pm["spec"]["selector"]["matchLabels"], _pod_labels(server))
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    _container_port(container, endpoint["port"])


# -- metrics: exported names, autoscalers, endpoint picker ----------------------------------------
def test_exported_metric_list_matches_the_server():
    metrics = Metrics(max_model_len=128, max_num_batched_tokens=64)
    metrics.set_cache_config("m", block_size=16, num_blocks=100)
    live, info_labels = set(), set()
    for family in metrics.registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "info": ["_info"]}.get(family.type, [""])
        live.update(family.name + s for s in suffixes)
        if family.type == "info":
            for sample in family.samples:
                info_labels.update(sample.labels)
    assert EXPORTED <= live, sorted(EXPORTED - live)
    assert info_labels == CACHE_INFO_LABELS


def _adapter_config(docs) -> dict:
    cm = _find(docs, "ConfigMap", "prometheus-adapter")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    jsonschema.validate(config, ADAPTER_CONFIG)
    return config


def _adapter_metric_names(docs) -> dict[str, str]:
    """{custom metrics API name: Prometheus series name} for every adapter rule."""
    names = {}
    for rule in _adapter_config(docs)["rules"]:
        m = re.match(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*\{", rule["seriesQuery"])
        assert m, f"seriesQuery should name its series: {rule['seriesQuery']}"
        series = m.group(1)
        assert series in EXPORTED, series
        # Go's regexp ${1} expansion, done with Python's re
        replacement = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule["name"]["as"])
        api_name = re.sub(rule["name"]["matches"], replacement, series)
        assert re.fullmatch(r"[a-z][a-z0-9_]*", api_name), \
            f"{series} would be exposed as {api_name!r}: not a plain Kubernetes metric name"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.Series>>" in rule["metricsQuery"]
        names[api_name] = series
    return names


def test_hpa_scales_the_server_on_an_adapter_metric(docs):
    hpa = _find(docs, "HorizontalPodAutoscaler", "tinyserve")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "tinyserve")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    adapter = _adapter_metric_names(docs)
    used = []
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] in ("Pods", "External"), metric["type"]
        name = metric[metric["type"].lower()]["metric"]["name"]
        assert name in adapter, f"{name} is not exposed by the prometheus-adapter rules"
        used.append(adapter[name])
    assert "tinyserve:num_requests_waiting" in used


def test_keda_scaledobject_queries_exported_metrics(server, docs):
    so = _find(docs, "ScaledObject", "tinyserve")
    target = so["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "tinyserve")
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    jsonschema.validate(trigger["metadata"], KEDA_PROMETHEUS_METADATA)
    query = trigger["metadata"]["query"]
    names = METRIC_RE.findall(query)
    assert "tinyserve:num_requests_waiting" in names
    assert set(names) <= EXPORTED, set(names) - EXPORTED
    # label matchers in the query exist on the series: copied from the pod by the PodMonitor
    pm = _find(docs, "PodMonitor", "tinyserve")
    target_labels = {re.sub(r"[^A-Za-z0-9_]", "_", k): _pod_labels(server)[k]
                     for k in pm["spec"].get("podTargetLabels", [])}
    for label, value in re.findall(r'(\w+)="([^"]*)"', query):
        if label not in ("namespace", "pod", "model"):
            assert target_labels.get(label) == value, f"no series carries {label}={value!r}"


def test_inference_pool_selects_the_server_and_its_picker(server, server_args, docs):
    pool = _find(docs, "InferencePool", "tinyserve")
    assert _selects(pool["spec"]["selector"]["matchLabels"], _pod_labels(server))
    assert pool["spec"]["targetPorts"][0]["number"] == server_args.port
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service"
    svc = _find(docs, "Service", ref["name"])
    epp = _find(docs, "Deployment", "tinyserve-epp")
    assert _selects(svc["spec"]["selector"], _pod_labels(epp))
    (epp_container,) = epp["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert _container_port(epp_container, port["targetPort"]) == 9002  # the EPP's --grpc-port
    route = _find(docs, "HTTPRoute", "tinyserve")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {(b["group"], b["kind"], b["name"]) for b in backends} == \
        {("inference.networking.k8s.io", "InferencePool", "tinyserve")}


def test_epp_flags_map_its_metrics_to_ours(server, docs):
    epp = _find(docs, "Deployment", "tinyserve-epp")
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert c["image"].endswith(":v1.3.1")  # the flag set below is that version's
    flags = _flag_values(c["args"])
    assert set(flags) <= EPP_FLAGS, set(flags) - EPP_FLAGS
    assert flags["pool-name"] == _find(docs, "InferencePool")["metadata"]["name"]
    assert flags.get("pool-group", "inference.networking.k8s.io") == "inference.networking.k8s.io"
    assert flags.get("model-server-metrics-path", "/metrics") == "/metrics"
    expected = {"total-queued-requests-metric": "tinyserve:num_requests_waiting",
                "total-running-requests-metric": "tinyserve:num_requests_running",
                "kv-cache-usage-percentage-metric": "tinyserve:kv_cache_usage_perc",
                "cache-info-metric": "tinyserve:cache_config_info"}
    for flag, metric in expected.items():
        spec = flags[flag]
        assert spec.split("{")[0] == metric, (flag, spec)
        assert metric in EXPORTED
    assert flags["lora-info-metric"] == ""  # no LoRA: empty disables that scrape
    # the prefix-cache scorer reads these labels of the cache-info metric
    assert {"block_size", "num_gpu_blocks"} <= CACHE_INFO_LABELS
    # its config file comes from a mounted ConfigMap that has it
    config_path = Path(flags["config-file"])
    (mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    cm_name = _volume(epp, mount["name"])["configMap"]["name"]
    config = yaml.safe_load(_find(docs, "ConfigMap", cm_name)["data"][config_path.name])
    assert config["kind"] == "EndpointPickerConfig"
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= defined
    # the picker outlives the pods it routes to while they drain (upstream's advice)
    assert (epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            >= server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
