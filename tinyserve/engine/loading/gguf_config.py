"""A GGUF file's metadata as the config.json keys model_config.py reads, so a GGUF model gets the
same ModelConfig (and the same checks) as its Hugging Face directory would.

llama.cpp's converter writes ``{arch}.*`` keys; where it writes none, llama.cpp's own loader
decides, and so do we, the same way (each case named below):

    arch      class                 what comes from where
    llama     LlamaForCausalLM      rope_freqs tensor -> per-frequency factors (llama3 scaling)
    qwen2     Qwen2ForCausalLM      q/k/v biases are tensors
    qwen3     Qwen3ForCausalLM      head_dim = attention.key_length
    gemma2    Gemma2ForCausalLM     soft-caps and window from the metadata; every other layer
                                    slides; query scale 1/sqrt(head_dim) (27B: hidden / heads)
    gemma3    Gemma3ForCausalLM     5 sliding layers to 1 global (sliding_window_pattern 6);
                                    local rope theta 10,000, the global one from rope.freq_base
    phi3      Phi3ForCausalLM       partial rotary from rope.dimension_count; LongRoPE factors are
                                    the rope_factors_long / _short tensors
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinyserve.formats.gguf import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# llama.cpp's 27B Gemmas scale queries by hidden / heads (their query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_raw_config(f: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's keys, generation_config.json's) for the model in ``f``."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {arch!r} is not supported; tinyserve "
                        f"serves {', '.join(ARCHITECTURES)}")
    if f.arch_key("expert_count"):
        raise GGUFError(f"{f.path}: {arch}.expert_count: mixture-of-experts models are not "
                        "supported")

    def need(key: str) -> Any:
        value = f.arch_key(key)
        if value is None:
            raise GGUFError(f"{f.path}: {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = f.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer (llama.cpp allows it): one value or none
        if len(set(kv_heads)) != 1:
            raise GGUFError(f"{f.path}: {arch}.attention.head_count_kv differs per layer "
                            f"({sorted(set(kv_heads))}): not supported")
        kv_heads = kv_heads[0]
    head_dim = int(f.arch_key("attention.key_length") or hidden // heads)
    layers = int(need("block_count"))
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": len(tokens) if tokens else int(need("vocab_size")),
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
        "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(f.arch_key("context_length", 2048)),
        # llama.cpp writes output.weight only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.metadata.get("tokenizer.ggml.bos_token_id"),
        "rope_parameters": _rope(f, head_dim),
    }
    window = f.arch_key("attention.sliding_window")
    present = {k: f.arch_key(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")
               if f.arch_key(k) is not None}  # (absent: the family's defaults, as llama.cpp's)
    if arch in ("gemma2", "gemma3"):
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        raw.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, **present)
        if window:
            raw["sliding_window"] = int(window)
    if arch == "gemma2":
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(layers)]
    elif arch == "gemma3":
        pattern = f.arch_key("attention.sliding_window_pattern", 6)  # a period, or per layer
        sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else \
            [bool((i + 1) % int(pattern)) for i in range(layers)]
        if len(sliding) != layers:
            raise GGUFError(f"{f.path}: {arch}.attention.sliding_window_pattern has "
                            f"{len(sliding)} entries for {layers} layers")
        raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        raw["rope_parameters"] = {"full_attention": raw["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0}}
    elif arch == "phi3" and window:
        raw["sliding_window"] = int(window)
    elif arch == "qwen2":
        raw["use_sliding_window"] = False
    ids = [f.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    gen = {"eos_token_id": sorted({int(i) for i in ids if i is not None})}
    return raw, gen


def _rope(f: GGUFFile, head_dim: int) -> dict[str, Any]:
    """rope_parameters: theta, partial rotary, and the scaling (metadata or tensors)."""
    theta = float(f.arch_key("rope.freq_base", 10000.0))
    rotary = int(f.arch_key("rope.dimension_count") or head_dim)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    kind = f.arch_key("rope.scaling.type", "none")
    factor = f.arch_key("rope.scaling.factor")
    original = f.arch_key("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in f.tensors:  # Phi-3's LongRoPE
        short = _floats(f, "rope_factors_short.weight")
        long = _floats(f, "rope_factors_long.weight")
        params.update(rope_type="longrope", short_factor=short, long_factor=long,
                      original_max_position_embeddings=int(original or f.arch_key(
                          "context_length")))
        if (attn := f.arch_key("rope.scaling.attn_factor")) is not None:
            params["attention_factor"] = float(attn)
    elif "rope_freqs.weight" in f.tensors:  # llama3 scaling, stored as its factors
        params.update(rope_type="freq_factors", factors=_floats(f, "rope_freqs.weight"))
    elif kind == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=float(factor),
                      original_max_position_embeddings=int(original))
    elif kind not in ("none", "linear"):
        raise GGUFError(f"{f.path}: {f.architecture}.rope.scaling.type {kind!r} is not supported "
                        "(none, linear, yarn)")
    return params


def _floats(f: GGUFFile, name: str) -> list[float]:
    t = f.tensors[name]
    if t.type_name != "F32":
        raise GGUFError(f"{f.path}: {name} is {t.type_name}, expected F32")
    values = np.frombuffer(f.data(name).tobytes(), dtype="<f4").tolist()
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise GGUFError(f"{f.path}: {name} holds factors that are not positive numbers")
    return values
