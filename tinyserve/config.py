"""Frozen, validated configuration. Pure Python (no torch): the control plane imports it.

Validation errors name the bad field, so CLI and API users see which knob is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to load a model and size its KV cache and batches."""

    model: str | None = None  # a Hugging Face model directory; None: the bundled stories260k
    random_demo: bool = False  # serve a random-weight demo model instead (load tests, no weights)
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's fp16/bf16 on GPU
    quantization: str | None = None  # "int8": weight-only, per output channel
    device: str | None = None  # "cuda" / "cpu"; None: cuda if available
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV capacity in blocks ...
    kv_cache_memory: int | None = None  # ... or in bytes; neither: sized from free memory
    gpu_memory_utilization: float = 0.90  # share of the GPU's free memory the KV cache may take
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (chunked prefill budget)
    max_model_len: int | None = None  # prompt + output limit; None: the model's own
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds unseeded requests, reproducibly per engine

    @property
    def resolved_model(self) -> str:
        """The model directory to load (the demo's is made on first use)."""
        if self.random_demo:
            return "tinyserve-demo"
        if self.model is None:
            from tinyserve.models import STORIES260K

            return str(STORIES260K)
        return self.model

    def __post_init__(self) -> None:
        if self.random_demo and self.model is not None:
            raise ValueError("random_demo and model are exclusive: give one")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks and kv_cache_memory are exclusive: give one")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant: who it is (its API key), what it may use, how it is treated under load."""

    name: str
    api_key: str | None = None  # None only for the implicit default tenant without --api-key
    priority: int = 0  # higher is scheduled first and preempted last
    max_concurrent: int | None = None  # requests admitted and not yet answered
    tokens_per_minute: int | None = None  # token bucket over prompt + completion tokens
    degradable: bool = False  # may be served by a fallback model when degraded
    cache_group: str | None = None  # prefix-cache sharing scope; None: the tenant's own
    admin: bool = False  # may change routes live

    def __post_init__(self) -> None:
        where = f"tenants.{self.name}"
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"tenant names are letters, digits, - and _; got {self.name!r}")
        for field in ("max_concurrent", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{where}.{field} must be a positive integer, got {value!r}")
        if type(self.priority) is not int:
            raise ValueError(f"{where}.priority must be an integer, got {self.priority!r}")

    @property
    def cache_salt(self) -> bytes:
        """Block hashes are keyed with this: tenants of different groups never share a block."""
        return (self.name if self.cache_group is None else self.cache_group).encode()

    @property
    def key_id(self) -> str:
        """What logs may show of the key: a short hash, never the key."""
        import hashlib

        return hashlib.sha256((self.api_key or "").encode()).hexdigest()[:8]


def load_tenants(path: str) -> tuple[TenantConfig, ...]:
    """``--tenants FILE``: one ``[tenants.NAME]`` table per tenant (TOML)."""
    import tomllib

    with open(path, "rb") as f:
        data = tomllib.load(f)
    tables = data.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{path}: expected one or more [tenants.NAME] tables")
    known = set(TenantConfig.__dataclass_fields__) - {"name"}
    tenants = []
    for name, table in tables.items():
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{path}: tenants.{name}: unknown keys {sorted(unknown)}")
        if not isinstance(table.get("api_key"), str):
            raise ValueError(f"{path}: tenants.{name}.api_key is required")
        tenants.append(TenantConfig(name=name, **table))
    keys = [t.api_key for t in tenants]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: two tenants share an api_key")
    return tuple(tenants)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front end and its admission control."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model directory's name
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_waiting: int = 256  # requests queued beyond max_num_seqs before 429s
    batch_timeout_ms: float = 0.0  # how long an idle engine waits to batch new arrivals
    drain_timeout_s: float = 30.0  # SIGTERM: time running requests get to finish
    step_timeout_s: float = 60.0  # a step running longer is a wedged device: unhealthy
    max_failed_steps: int = 3  # this many failed steps in a row: unhealthy
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413 before they are parsed
    tenants: tuple[TenantConfig, ...] = ()  # from --tenants; empty: one default tenant
    slo_ttft_ms: float | None = None  # P95 time-to-first-token target: enables SLO control
    slo_itl_ms: float | None = None  # P95 inter-token latency target
    log_level: str = "info"

    @property
    def tenant_list(self) -> tuple[TenantConfig, ...]:
        """The tenants; without a tenants file, one default tenant holding --api-key."""
        return self.tenants or (TenantConfig("default", self.api_key, cache_group=""),)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.batch_timeout_ms < 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {self.max_failed_steps}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.tenants and self.api_key:
            raise ValueError("api_key and tenants are exclusive: put keys in the tenants file")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")
