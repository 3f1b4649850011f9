"""Frozen, validated configuration. Pure Python (no torch): the control plane imports it.

Validation errors name the bad field, so CLI and API users see which knob is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

BUNDLED = "stories260k"  # as a model directory: the model inside the package (if no such dir)
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = (None, "int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
METRICS_NAMESPACES = ("tinyserve", "vllm")  # the prefix of every Prometheus series name
TOOL_CALL_PARSERS = ("auto", "llama3_json", "hermes")  # auto: hermes if the template says
# chat content's special-token text: plain text (default), or parsed as transformers/vLLM do
SPECIAL_TOKENS_IN_CONTENT = ("text", "parse")


# -- speculative decoding (vLLM's --speculative-config; core/speculation.py runs it) ------------

SPECULATIVE_METHODS = ("ngram", "draft_model")
REFUSED_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
                               "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp", "suffix")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # n-gram: the longest suffix looked up in the history
    prompt_lookup_min: int = 2  # ... the shortest
    model: str | None = None  # draft_model: its checkpoint (same tokenizer as the target)
    quantization: str | None = None  # draft_model: its weights' format (int4: a cheap self-draft)
    # No speculation in steps with more running sequences than this (on a full batch a
    # verify step costs more than it saves)
    disable_by_batch_size: int = 8
    # A request whose draft tokens are accepted less than this often (a running mean over
    # its verify steps) stops speculating: its proposals are not paying for their positions
    min_acceptance: float = 0.1

    def __post_init__(self) -> None:
        self._check_types()
        if self.method in REFUSED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported: it "
                             "needs a trained head; ngram and draft_model are")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError("speculative_config.method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method[:40]!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 32, got prompt_lookup_min="
                             f"{self.prompt_lookup_min} and prompt_lookup_max="
                             f"{self.prompt_lookup_max}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError("speculative_config.quantization must be one of "
                             f"{', '.join(str(q) for q in QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: a draft_model needs its checkpoint")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is for method draft_model")
        if self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")
        if not 0 <= self.min_acceptance < 1:
            raise ValueError("speculative_config.min_acceptance must be in [0, 1), got "
                             f"{self.min_acceptance}")

    def _check_types(self) -> None:
        """The JSON's types (a user's --speculative-config): bools are not numbers, counts
        are integers, the acceptance rate a finite number, names strings."""
        def refuse(name: str, kind: str) -> ValueError:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            return ValueError(f"speculative_config.{name} must be {kind}, got {shown}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            if type(getattr(self, name)) is not int:
                raise refuse(name, "an integer")
        if type(self.min_acceptance) not in (int, float) or \
                not math.isfinite(self.min_acceptance):
            raise refuse("min_acceptance", "a finite number")
        object.__setattr__(self, "min_acceptance", float(self.min_acceptance))
        if type(self.method) is not str:
            raise refuse("method", "a string")
        for name in ("model", "quantization"):
            if getattr(self, name) is not None and type(getattr(self, name)) is not str:
                raise refuse(name, "a string or null")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to load a model and size its KV cache and batches."""

    model: str | None = None  # a Hugging Face model directory; None: the bundled stories260k
    random_demo: bool = False  # serve a random-weight demo model instead (load tests, no weights)
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's fp16/bf16 on GPU
    # weight-only: "int8" per output channel, "int4" group-wise (128); a GPTQ / AWQ checkpoint
    # is recognised by its config.json and needs none
    quantization: str | None = None
    dequantize: bool = False  # a GGUF file's weights as floats in dtype, not its quantized forms
    kv_cache_dtype: str = "auto"  # "int8": K and V as int8, a scale per token and KV head
    device: str | None = None  # "cuda" / "cpu"; None: cuda if available
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV capacity in blocks ...
    kv_cache_memory: int | None = None  # ... or in bytes; neither: sized from free memory
    gpu_memory_utilization: float = 0.90  # share of the GPU's free memory the KV cache may take
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (chunked prefill budget)
    max_model_len: int | None = None  # prompt + output limit; None: the model's own
    enable_prefix_caching: bool = True
    # No decode buckets: every step runs the launchers directly (no padding, no recorded
    # launches, no CUDA graphs) - for debugging, and to compare against.
    enforce_eager: bool = False
    seed: int = 0  # seeds unseeded requests, reproducibly per engine
    # Compiled grammars (structured output), bounded in estimated bytes: the whole cache, each
    # tenant's cache group, and one grammar (larger ones are refused with a 400).
    grammar_cache_bytes: int = 512 << 20
    grammar_tenant_cache_bytes: int = 128 << 20
    grammar_max_bytes: int = 64 << 20
    # LoRA adapters (engine/lora.py): device slots (0: none served), the largest rank, and
    # how many adapters host memory keeps (None: max_loras)
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (core/speculation.py): None, or how to propose and when
    speculative: SpeculativeConfig | None = None
    # Several models in one process (build_models sets these): this model's share of the KV
    # budget; sized from free GPU memory, the share of what is free when it loads that it
    # takes, and the bytes to leave for the weights of the models loaded after it.
    kv_share: float = 1.0
    kv_share_of_free: float = 1.0
    kv_reserve_bytes: int = 0

    @property
    def resolved_model(self) -> str:
        """The model directory to load (the demo's is made on first use)."""
        if self.random_demo:
            return "tinyserve-demo"
        if self.model is None or (self.model == BUNDLED and not Path(self.model).exists()):
            from tinyserve.models import STORIES260K

            return str(STORIES260K)
        return self.model

    def __post_init__(self) -> None:
        if self.random_demo and self.model is not None:
            raise ValueError("random_demo and model are exclusive: give one")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
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
        if not (0.0 < self.kv_share <= 1.0 and 0.0 < self.kv_share_of_free <= 1.0):
            raise ValueError(f"kv_share must be in (0, 1], got {self.kv_share}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank in [1, 256], got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < max(self.max_loras, 1):
            raise ValueError(f"max_cpu_loras must be >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras}")
        for name in ("grammar_cache_bytes", "grammar_tenant_cache_bytes", "grammar_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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
    admin: bool = False  # may change routes live, load and unload LoRA adapters
    # LoRA adapters it may use (None: all of them; admins: all; the base models always)
    adapters: tuple[str, ...] | None = None

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
        if self.adapters is not None and (not isinstance(self.adapters, (list, tuple)) or not all(
                isinstance(a, str) for a in self.adapters)):
            raise ValueError(f"{where}.adapters must be a list of adapter names")
        if isinstance(self.adapters, list):
            object.__setattr__(self, "adapters", tuple(self.adapters))
        for field in ("degradable", "admin"):
            if type(getattr(self, field)) is not bool:
                raise ValueError(f"{where}.{field} must be true or false, got "
                                 f"{getattr(self, field)!r}")

    def may_use(self, adapter: str) -> bool:
        return self.admin or self.adapters is None or adapter in self.adapters

    @property
    def cache_salt(self) -> bytes:
        """Block hashes are keyed with this: tenants of different groups never share a block."""
        return (self.name if self.cache_group is None else self.cache_group).encode()

    @property
    def key_id(self) -> str:
        """What logs may show of the key: a short hash, never the key."""
        import hashlib

        return hashlib.sha256((self.api_key or "").encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front end and its admission control."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_waiting: int = 256  # requests queued beyond max_num_seqs before 429s
    batch_timeout_ms: float = 0.0  # how long an idle engine waits to batch new arrivals
    overlap: bool = True  # plan each step while the previous one runs (async scheduling)
    stream_interval: int = 1  # a request's tokens go out every this many (first, last at once)
    # hand-offs to stream readers a second, per model (actors/replies.py); 0: no limit
    stream_write_rate: float = 8000.0
    drain_timeout_s: float = 30.0  # SIGTERM: time running requests get to finish
    step_timeout_s: float = 60.0  # a step running longer is a wedged device: unhealthy
    max_failed_steps: int = 3  # this many failed steps in a row: unhealthy
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413 before they are parsed
    tenants: tuple[TenantConfig, ...] = ()  # from --tenants; empty: one default tenant
    slo_ttft_ms: float | None = None  # P95 time-to-first-token target: enables SLO control
    slo_itl_ms: float | None = None  # P95 inter-token latency target
    routes: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()  # --route (parse_route)
    fallbacks: tuple[tuple[str, str], ...] = ()  # --fallback (parse_fallback)
    log_level: str = "info"
    access_log: bool = False  # one JSON line per API request on stdout (access_log.py)
    metrics_namespace: str = "tinyserve"  # "vllm": series named as vLLM's, for its dashboards
    tool_call_parser: str = "auto"  # how chat output becomes tool_calls (api/tools/parsers.py)
    # "text": special-token text in chat message content is tokenized as text, so content cannot
    # forge a turn or an EOS (prompts.py); "parse": as transformers and vLLM do
    special_tokens_in_content: str = "text"
    # --lora-modules: (name, PEFT directory, base model or None: the first served model)
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    # POST /v1/responses with store: the responses kept for previous_response_id and GET, per
    # tenant (least recently used dropped first, by count and by bytes)
    responses_store_max: int = 1000
    responses_store_max_bytes: int = 64 * 2**20

    @property
    def tenant_list(self) -> tuple[TenantConfig, ...]:
        """The tenants; without a tenants file, one default tenant holding --api-key."""
        # The default tenant is the operator (it may change routes): with --api-key, whoever
        # holds the key; without one the whole API is open anyway.
        return self.tenants or (TenantConfig("default", self.api_key, cache_group="", admin=True),)

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
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.stream_write_rate >= 0:
            raise ValueError(f"stream_write_rate must be >= 0, got {self.stream_write_rate}")
        if self.max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {self.max_failed_steps}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.responses_store_max < 0 or self.responses_store_max_bytes < 0:
            raise ValueError("responses_store_max and responses_store_max_bytes must be >= 0")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.tenants and self.api_key:
            raise ValueError("api_key and tenants are exclusive: put keys in the tenants file")
        if self.api_key is not None and (not self.api_key.strip()
                                         or self.api_key != self.api_key.strip()):
            # (an unset variable, --api-key "$KEY", would otherwise open the server to all)
            raise ValueError("api_key is empty or has spaces around it: give a key, or leave "
                             "--api-key out for a server without keys")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
            raise ValueError("special_tokens_in_content must be one of "
                             f"{', '.join(SPECIAL_TOKENS_IN_CONTENT)}, "
                             f"got {self.special_tokens_in_content!r}")
        if self.metrics_namespace not in METRICS_NAMESPACES:
            raise ValueError(f"metrics_namespace must be one of {', '.join(METRICS_NAMESPACES)}, "
                             f"got {self.metrics_namespace!r}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: the name clients send as ``model``, and how to load it."""

    name: str
    engine: EngineConfig
