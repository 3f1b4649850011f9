"""The sparse feed-forward's part of a config.json (model_config.py reads the rest): each MoE
family's expert count, top k, expert size, routing mode, dense layers and extras, and the MoE
keys whose other values this forward pass does not compute (refused by name)."""

from __future__ import annotations

from typing import Any

# MoE config keys whose other values this forward pass does not compute (refused by name)
MOE_REFUSED = {"n_group": (None, 1), "topk_group": (None, 1), "n_shared_experts": (None, 0),
               "shared_expert_intermediate_size": (None, 0), "router_jitter_noise": (None, 0.0),
               "moe_layer_freq": (None, 1), "first_k_dense_replace": (None, 0)}


def refused_moe_key(raw: dict[str, Any], family: str) -> str | None:
    """The first MoE key whose value is not computed here, or None."""
    for key, allowed in MOE_REFUSED.items():
        if raw.get(key) not in allowed and not (family == "qwen2_moe"
                                                and key == "shared_expert_intermediate_size"):
            return key
    return None


def experts_config(raw: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The sparse feed-forward's switches (none for a dense family)."""
    if family == "mixtral":
        return dict(num_experts=int(raw.get("num_local_experts", 8)),
                    experts_per_token=int(raw.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(raw["intermediate_size"]), moe_renormalize=True)
    if family == "gpt_oss":
        return dict(num_experts=int(raw.get("num_local_experts", 128)),
                    experts_per_token=int(raw.get("num_experts_per_tok", 4)),
                    moe_intermediate_size=int(raw["intermediate_size"]),
                    moe_softmax_first=False, moe_activation="swiglu_oai",
                    swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(raw.get("swiglu_limit", 7.0)), moe_biases=True)
    if family == "olmoe":
        return dict(num_experts=int(raw.get("num_experts", raw.get("num_local_experts", 64))),
                    experts_per_token=int(raw.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(raw["intermediate_size"]),
                    moe_renormalize=bool(raw.get("norm_topk_prob", False)))
    if family in ("qwen2_moe", "qwen3_moe"):
        step = int(raw.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        # (transformers 5 writes num_local_experts, older configs num_experts)
        experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        dense |= {i for i in range(num_layers) if experts == 0 or (i + 1) % step}
        return dict(num_experts=experts, experts_per_token=int(raw.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(raw.get("moe_intermediate_size", 768)),
                    moe_renormalize=bool(raw.get("norm_topk_prob", False)),
                    dense_layers=tuple(sorted(dense)),
                    shared_expert_size=int(raw.get("shared_expert_intermediate_size") or 0)
                    if family == "qwen2_moe" else 0)
    return {}
