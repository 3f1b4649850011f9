"""One model description for every family: what a checkpoint's config.json asks of the forward
pass, as a row of switches. Llama is the plain row; each family sets the switches it needs:

    family (architecture)      switches it sets
    Llama (LlamaForCausalLM)   attention_bias (q/k/v/o), mlp_bias, rope default/linear/llama3/...
    Mistral                    head_dim; sliding_window on every layer
    Qwen2                      q/k/v bias; sliding window on layers >= max_window_layers
    Qwen3                      q/k norm (RMSNorm over head_dim); head_dim; attention_bias
    Gemma 2                    (1 + w) norms, four per layer (sandwich); embeddings x sqrt(hidden);
                               GeGLU (gelu tanh); scale query_pre_attn_scalar^-0.5; soft-caps;
                               sliding window on alternate layers; tied head
    Gemma 3 (text)             Gemma 2 + (1 + w) q/k norm; local:global layers by layer_types;
                               local layers' own rope (rope_local_base_freq / sliding_attention)
    Phi-3 / 3.5 / Phi-4-mini   fused qkv_proj and gate_up_proj; partial rotary; LongRoPE; window
    Mixtral                    Mistral's attention; every feed-forward sparse: num_local_experts,
                               top num_experts_per_tok of a softmax, renormalised
    Qwen3-MoE                  Qwen3's attention; sparse feed-forwards of moe_intermediate_size
                               (norm_topk_prob), dense ones on mlp_only_layers and off
                               decoder_sparse_step
    Qwen2-MoE                  Qwen2's attention (qkv_bias); Qwen3-MoE's experts plus a shared
                               expert (shared_expert_intermediate_size) through a sigmoid gate
    OLMoE                      q/k RMSNorm over the whole projection (not per head); every layer
                               sparse, experts of intermediate_size (norm_topk_prob)
    gpt-oss                    attention sinks (a logit per head); q/k/v/o bias; a window of 128
                               on alternate layers; YaRN; every layer sparse: a router with a
                               bias, top k then a softmax over them, experts with biases and the
                               clamped SwiGLU (interleaved gate / up)

The loaders map each family's weight names onto the same layer (checkpoint.py,
gguf_weights.py). A config key that changes the computation and is not honoured is refused by
name (never load a model and compute something else): ``_refuse``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyserve.engine.loading.moe_config import experts_config, refused_moe_key
from tinyserve.formats.gguf import is_gguf

FAMILIES = {  # architecture -> model_type
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe", "GptOssForCausalLM": "gpt_oss",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope",
              "freq_factors")  # (the last: GGUF's rope_freqs, never a config.json key)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class ModelLoadError(Exception):
    """A model directory that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: default rope; else with its "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    architecture: str = "LlamaForCausalLM"
    # -- the switches (defaults: Llama) --
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before rope
    qk_norm_whole: bool = False  # RMSNorm over all of q's (k's) heads at once (OLMoE)
    norm_unit_offset: bool = False  # every RMSNorm times (1 + w), in fp32 (Gemma)
    sandwich_norms: bool = False  # post-attention, pre- and post-feedforward norms (Gemma)
    activation: str = "silu"  # "silu" | "gelu_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size), rounded to the model dtype
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint
    rotary_dim: int | None = None  # partial rotary; None: head_dim
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    # Gemma 3: the sliding layers' own rope (None: the same as every layer's)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None)
    # mixture of experts (engine/model/moe.py): 0 experts is a dense model
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_softmax_first: bool = True  # softmax over all experts, then the top k (else: top k,
    moe_renormalize: bool = False   # then a softmax over them); the k weights summed to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense feed-forward in a sparse model
    shared_expert_size: int = 0  # a shared expert beside the routed ones (0: none)
    moe_activation: str = ""  # the experts' ("": ``activation``); "swiglu_oai" (gpt-oss)
    swiglu_alpha: float = 1.702  # (swiglu_oai's)
    swiglu_limit: float = 7.0
    moe_biases: bool = False  # the router and every expert have biases (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, or None (full attention)."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def uses_local_rope(self, layer: int) -> bool:
        return self.local_rope_theta is not None and self.window(layer) is not None

    @property
    def every_layer_windowed(self) -> bool:
        """Every layer slides: a sequence's blocks wholly behind the window can be released."""
        return self.sliding_window is not None and all(
            self.window(i) is not None for i in range(self.num_layers))


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(raw: dict[str, Any], params: dict[str, Any] | None, default_theta: float,
          family: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from one rope block (rope_scaling wins over rope_parameters, as
    in transformers), theta falling back to the top-level rope_theta. Phi-3's "su" and "yarn"
    (with short / long factors) are transformers' longrope."""
    params = params or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta") or default_theta))
    scaling = None
    kind = params.get("rope_type", params.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn") and "long_factor" in params:
        kind = "longrope"
    if kind != "default":
        scaling = {**params, "rope_type": kind}
        if kind in ("llama3", "yarn", "longrope"):  # the pretraining length (transformers'
            top = raw.get("original_max_position_embeddings")  # rule: the top-level key wins)
            if top is not None:
                scaling["original_max_position_embeddings"] = top
            else:
                scaling.setdefault("original_max_position_embeddings",
                                   raw.get("max_position_embeddings"))
    return theta, scaling


def _layer_types(raw: dict[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    """config.json's layer_types, else what transformers derives for the family."""
    given = raw.get("layer_types")
    if family == "llama":  # transformers' Llama has no window, whatever the config says
        return ()
    qwen = family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if given and not (qwen and not raw.get("use_sliding_window")):
        return tuple(given)
    window = raw.get("sliding_window")
    if qwen:  # (no window unless use_sliding_window, whatever else)
        if not raw.get("use_sliding_window") or window is None:
            return ()
        first = int(raw.get("max_window_layers", 28))
        return tuple("sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers))
    if family in ("gemma2", "gpt_oss"):
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(num_layers))
    if family == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers))
    if window is not None:  # Mistral, Phi-3: every layer
        return ("sliding_attention",) * num_layers
    return ()


def _switches(raw: dict[str, Any], family: str, head_dim: int, hidden: int) -> dict[str, Any]:
    gemma = family in ("gemma2", "gemma3_text")
    bias = bool(raw.get("attention_bias", False))
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in ("silu", *GELU_TANH):
        raise ValueError(f"hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    out = dict(
        qkv_bias=bias or family == "qwen2" or (family == "qwen2_moe" and raw.get("qkv_bias", True)),
        o_bias=bias, mlp_bias=bool(raw.get("mlp_bias")),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"), qk_norm_whole=family == "olmoe",
        attn_sinks=family == "gpt_oss",
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        activation="gelu_tanh" if act in GELU_TANH else "silu",
        fused_checkpoint=family == "phi3")
    if gemma:
        out.update(attn_scale=float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                   # Gemma 3 keeps the key but replaced attention soft-capping with q/k norm:
                   # transformers (and vLLM) never apply it there
                   attn_softcap=raw.get("attn_logit_softcapping") if family == "gemma2" else None,
                   final_softcap=raw.get("final_logit_softcapping"),
                   embed_scale=math.sqrt(hidden))
    return out


# What transformers' config classes assume for a key a config.json leaves out (where that is
# not Llama's default): a hand-written config must not silently compute another model.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 128},
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
               "head_dim": 256, "sliding_window": 4096},
    "gemma3_text": {"query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "head_dim": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0},
    "phi3": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128, "attention_bias": True,
                "rms_norm_eps": 1e-5, "rope_parameters": {
                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 4096}},
}


def _refuse(raw: dict[str, Any], family: str, path: Path) -> None:
    """Config keys that change the computation in ways this forward pass does not do."""
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention is not supported (causal only)")
    if family == "llama" and raw.get("pretraining_tp", 1) not in (1, None):
        raise ModelLoadError(f"{path}: pretraining_tp {raw['pretraining_tp']} is not supported")
    if raw.get("layer_types") and set(raw["layer_types"]) - {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"{path}: layer_types {sorted(set(raw['layer_types']))} are not "
                             "supported (full_attention, sliding_attention)")
    if (key := refused_moe_key(raw, family)) is not None:
        raise ModelLoadError(f"{path}: {key}={raw[key]!r} is not supported (the sparse "
                             "feed-forward here: routed experts, no groups or shared ones)")
    if raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"{path}: clip_qkv={raw['clip_qkv']!r} is not supported")
    qc = raw.get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4" and family != "gpt_oss":
        raise ModelLoadError(f"{path}: quantization_config.quant_method 'mxfp4' is supported for "
                             "gpt-oss's experts only")
    # (gpt-oss's MXFP4 names the modules it keeps in bf16: everything but the experts)
    if qc.get("modules_to_not_convert") and qc.get("quant_method") != "mxfp4":
        raise ModelLoadError(f"{path}: quantization_config.modules_to_not_convert is not supported")


def load_model_config(model: str | Path) -> ModelConfig:
    """A Hugging Face directory's config.json (and generation_config.json), or a GGUF file's
    metadata read into the same keys (gguf_config.py)."""
    model = Path(model)
    if is_gguf(model):
        from tinyserve.engine.loading.gguf_config import gguf_raw_config
        from tinyserve.formats.gguf import GGUFError, GGUFFile

        try:
            raw, gen = gguf_raw_config(GGUFFile(model))
        except GGUFError as e:
            raise ModelLoadError(str(e)) from e
        return model_config_from(raw, gen, model)
    path = model / "config.json"
    if not model.is_dir():
        raise ModelLoadError(f"{model}: not a directory (a Hugging Face model directory or a "
                             ".gguf file)")
    if not path.exists():
        raise ModelLoadError(f"{path}: missing (expected a Hugging Face config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    return model_config_from(raw, gen, path)


def model_config_from(raw: dict[str, Any], gen: dict[str, Any], path: Path) -> ModelConfig:
    """config.json's keys (and generation_config.json's) -> ModelConfig; ``path`` names the
    source in errors."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None and raw.get("model_type") in FAMILIES.values():
        arch = next(a for a, t in FAMILIES.items() if t == raw["model_type"])
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"tinyserve serves {', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    raw = {**FAMILY_DEFAULTS.get(family, {}), **raw}
    _refuse(raw, family, path)
    try:
        cfg = _parse(raw, arch, family, gen)
    except KeyError as e:
        raise ModelLoadError(f"{path}: required field {e.args[0]!r} is missing") from e
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    _check(cfg, path)
    _check_token_ids(raw, gen, cfg.vocab_size, path)
    return cfg


def _check_token_ids(raw: dict[str, Any], gen: dict[str, Any], vocab: int, path: Path) -> None:
    """bos / eos ids from config.json and generation_config.json, range-checked where they
    enter: an id past the vocabulary would fault every step that masks it."""
    gen_path = path.with_name("generation_config.json") if path.name == "config.json" else path
    for source, where in ((raw, path), (gen, gen_path)):
        for key in ("bos_token_id", "eos_token_id"):
            value = source.get(key)
            for i in value if isinstance(value, list) else [value]:
                if i is not None and (type(i) is not int or not 0 <= i < vocab):
                    raise ModelLoadError(f"{where}: {key} {str(i)[:40]} is not a token id of "
                                         f"the vocabulary (vocab_size {vocab})")


def _parse(raw: dict[str, Any], arch: str, family: str, gen: dict[str, Any]) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    layered = "full_attention" in params or "sliding_attention" in params  # (Gemma 3)
    theta, scaling = _rope(raw, params.get("full_attention") if layered else params,
                           1_000_000.0 if family == "gemma3_text" else 10000.0, family)
    local_theta = local_scaling = None
    if family == "gemma3_text":
        local = params.get("sliding_attention") if layered else {
            "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        local_theta, local_scaling = _rope({}, local, 10000.0, family)
    partial = next((float(v) for v in (params.get("partial_rotary_factor"),
                                       (raw.get("rope_parameters") or {}).get("partial_rotary_factor"),
                                       raw.get("partial_rotary_factor")) if v is not None), 1.0)
    num_layers = int(raw["num_hidden_layers"])
    layer_types = _layer_types(raw, family, num_layers)
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=num_layers,
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.startswith("gemma"))),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(gen.get("eos_token_id", raw.get("eos_token_id"))),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), architecture=arch,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
        sliding_window=raw.get("sliding_window") if layer_types else None,
        layer_types=layer_types, local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        **_switches(raw, family, head_dim, hidden), **experts_config(raw, family, num_layers))


def _check(cfg: ModelConfig, path: Path) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {cfg.num_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_kv_heads}")
    rotary = cfg.rotary_dim or cfg.head_dim
    if rotary % 2 or rotary > cfg.head_dim:
        raise ModelLoadError(f"{path}: the rotary dimension {rotary} must be even and at most "
                             f"head_dim {cfg.head_dim}")
    if cfg.layer_types and len(cfg.layer_types) != cfg.num_layers:
        raise ModelLoadError(f"{path}: layer_types has {len(cfg.layer_types)} entries for "
                             f"{cfg.num_layers} layers")
    if cfg.num_experts and not (1 <= cfg.experts_per_token <= min(cfg.num_experts, 16)
                                and cfg.num_experts <= 256 and cfg.moe_intermediate_size > 0):
        raise ModelLoadError(f"{path}: {cfg.num_experts} experts, top {cfg.experts_per_token}: "
                             "1 to 256 experts and a top k of 1 to 16 are supported")
    if cfg.layer_types and "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise ModelLoadError(f"{path}: sliding layers need a sliding_window")
    for scaling in (cfg.rope_scaling, cfg.local_rope_scaling):
        if scaling and scaling["rope_type"] not in ROPE_TYPES:
            raise ModelLoadError(f"{path}: rope_scaling type {scaling['rope_type']!r} is not "
                                 f"supported ({', '.join(ROPE_TYPES)})")
