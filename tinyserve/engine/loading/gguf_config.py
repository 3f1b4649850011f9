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

The metadata is untrusted: every value is read through a typed getter that refuses a value of
the wrong kind or range by file and key (a head count of 0, yarn without its factor), and
block_count must match the layers whose tensors the file holds before anything is built per
layer (2^40 would otherwise build a list of 2^40).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from tinyserve.formats.gguf import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# llama.cpp's 27B Gemmas scale queries by hidden / heads (their query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK = re.compile(r"blk\.(\d+)\.")


class _Keys:
    """The file's ``{arch}.*`` keys, typed: a value of the wrong kind or out of its range is
    refused by file and key."""

    def __init__(self, f: GGUFFile) -> None:
        self.f, self.arch = f, f.architecture

    def error(self, key: str, why: str) -> GGUFError:
        return GGUFError(f"{self.f.path}: {self.arch}.{key} {why}")

    def raw(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        return self.f.get(f"{self.arch}.{key}", kind, default)

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer; required unless there is a ``default``."""
        value = self.optional(key)
        if value is None and default is None:
            raise self.error(key, "is missing")
        return default if value is None else value

    def optional(self, key: str) -> int | None:
        value = self.raw(key, int)
        if value is not None and value < 1:
            raise self.error(key, f"is {value}: it must be a positive integer")
        return value

    def real(self, key: str, default: float | None = None) -> float | None:
        """A positive finite number, or ``default``."""
        value = self.raw(key, (int, float), default)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise self.error(key, f"is {value}: it must be a positive number")
        return None if value is None else float(value)


def gguf_raw_config(f: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's keys, generation_config.json's) for the model in ``f``."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {arch!r} is not supported; tinyserve "
                        f"serves {', '.join(ARCHITECTURES)}")
    k = _Keys(f)
    if k.raw("expert_count", int):
        raise GGUFError(f"{f.path}: {arch}.expert_count: mixture-of-experts models are not "
                        "supported")
    hidden, heads = k.count("embedding_length"), k.count("attention.head_count")
    layers = _block_count(k)
    head_dim = k.optional("attention.key_length") or hidden // heads
    if head_dim < 1:
        raise k.error("attention.head_count", f"is {heads}, more than embedding_length "
                      f"{hidden}, and no attention.key_length gives the head size")
    tokens = f.items("tokenizer.ggml.tokens", str)
    vocab = len(tokens) if tokens else k.count("vocab_size")
    ids = f.special_ids(vocab)
    context = k.count("context_length", 2048)
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": k.count("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(k, heads), "head_dim": head_dim,
        "rms_norm_eps": k.real("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": context,
        # llama.cpp writes output.weight only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": ids.get("bos"),
        "rope_parameters": _rope(k, head_dim, context),
    }
    _attention(k, raw, layers)
    gen = {"eos_token_id": sorted({ids[n] for n in ("eos", "eot", "eom") if n in ids})}
    return raw, gen


def _block_count(k: _Keys) -> int:
    """block_count, checked against the layers whose tensors the file holds (blk.N.*) before
    anything is built per layer."""
    count = k.count("block_count")
    held = {int(m[1]) for name in k.f.tensors if (m := _BLOCK.match(name))}
    if count != len(held) or (held and max(held) != count - 1):
        where = f" (blk.{min(held)} to blk.{max(held)})" if held else ""
        raise k.error("block_count", f"is {count}, but the file holds tensors of {len(held)} "
                      f"layers{where}")
    return count


def _kv_heads(k: _Keys, heads: int) -> int:
    key = "attention.head_count_kv"
    if not isinstance(k.f.arch_key(key), list):
        return k.count(key, heads)
    per_layer = k.f.items(f"{k.arch}.{key}", int)  # (llama.cpp allows it): one value or none
    if len(set(per_layer)) != 1:
        raise k.error(key, f"differs per layer ({sorted(set(per_layer))[:8]}): not supported")
    if per_layer[0] < 1:
        raise k.error(key, f"is {per_layer[0]}: it must be a positive integer")
    return per_layer[0]


def _attention(k: _Keys, raw: dict[str, Any], layers: int) -> None:
    """Each family's windows, soft-caps and query scale, into ``raw``."""
    arch, hidden, heads = k.arch, raw["hidden_size"], raw["num_attention_heads"]
    window = k.raw("attention.sliding_window", int)  # (0: none)
    if window is not None and window < 0:
        raise k.error("attention.sliding_window", f"is {window}: it must not be negative")
    present = {key: value for key in ("attn_logit_softcapping", "final_logit_softcapping")
               if (value := k.real(key)) is not None}  # (absent: the family's defaults)
    if arch in ("gemma2", "gemma3"):
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else raw["head_dim"]
        raw.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, **present)
        if window:
            raw["sliding_window"] = window
    if arch == "gemma2":
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(layers)]
    elif arch == "gemma3":
        raw["layer_types"] = ["sliding_attention" if s else "full_attention"
                              for s in _gemma3_sliding(k, layers)]
        raw["rope_parameters"] = {"full_attention": raw["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0}}
    elif arch == "phi3" and window:
        raw["sliding_window"] = window
    elif arch == "qwen2":
        raw["use_sliding_window"] = False


def _gemma3_sliding(k: _Keys, layers: int) -> list[bool]:
    """Which layers slide: sliding_window_pattern is a period, or one flag per layer."""
    key = "attention.sliding_window_pattern"
    if not isinstance(k.f.arch_key(key), list):
        period = k.count(key, 6)
        return [bool((i + 1) % period) for i in range(layers)]
    flags = k.f.items(f"{k.arch}.{key}", (bool, int))
    if len(flags) != layers:
        raise k.error(key, f"has {len(flags)} entries for {layers} layers")
    return [bool(p) for p in flags]


def _rope(k: _Keys, head_dim: int, context: int) -> dict[str, Any]:
    """rope_parameters: theta, partial rotary, and the scaling (metadata or tensors)."""
    f = k.f
    theta = k.real("rope.freq_base", 10000.0)
    rotary = k.count("rope.dimension_count", head_dim)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    kind = k.raw("rope.scaling.type", str, "none")
    factor = k.real("rope.scaling.factor")
    original = k.optional("rope.scaling.original_context_length") or context
    if "rope_factors_long.weight" in f.tensors:  # Phi-3's LongRoPE
        short = _floats(f, "rope_factors_short.weight")
        long = _floats(f, "rope_factors_long.weight")
        params.update(rope_type="longrope", short_factor=short, long_factor=long,
                      original_max_position_embeddings=original)
        if (attn := k.real("rope.scaling.attn_factor")) is not None:
            params["attention_factor"] = attn
    elif "rope_freqs.weight" in f.tensors:  # llama3 scaling, stored as its factors
        params.update(rope_type="freq_factors", factors=_floats(f, "rope_freqs.weight"))
    elif kind == "linear" and factor:
        params.update(rope_type="linear", factor=factor)
    elif kind == "yarn":
        if factor is None:
            raise k.error("rope.scaling.factor", "is missing (rope.scaling.type is yarn)")
        params.update(rope_type="yarn", factor=factor, original_max_position_embeddings=original)
    elif kind not in ("none", "linear"):
        raise GGUFError(f"{f.path}: {f.architecture}.rope.scaling.type {kind[:40]!r} is not "
                        "supported (none, linear, yarn)")
    return params


def _floats(f: GGUFFile, name: str) -> list[float]:
    t = f.tensors.get(name)
    if t is None:
        raise GGUFError(f"{f.path}: {name} is missing")
    if t.type_name != "F32":
        raise GGUFError(f"{f.path}: {name} is {t.type_name}, expected F32")
    values = np.frombuffer(f.data(name).tobytes(), dtype="<f4").tolist()
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise GGUFError(f"{f.path}: {name} holds factors that are not positive numbers")
    return values
