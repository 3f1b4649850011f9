"""Random-weight base models and PEFT LoRA adapters for the LoRA tests (transformers + peft),
and PEFT's answers to compare against."""

from __future__ import annotations

from pathlib import Path

import torch

# Three adapters of different ranks and targets: attention only, everything, and the output
# projections with rsLoRA. Their weights are scaled up so each moves the logits well past
# the comparison's tolerance.
ADAPTERS = {
    "a_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "a_all": dict(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a_out": dict(r=16, lora_alpha=8, target_modules=["o_proj", "down_proj"], use_rslora=True),
}


def llama_config(transformers):
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-5)


def qwen3_config(transformers):
    return transformers.Qwen3Config(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.15, rms_norm_eps=1e-6)


def qwen3moe_config(transformers):
    """Qwen3-MoE: sparse layers 0 and 2 (6 experts, top 2), a dense one (1) between them."""
    return transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.15, rms_norm_eps=1e-6, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])


def write_base_and_adapters(root: Path, config, seed: int = 0,
                            adapters: dict | None = None) -> dict[str, Path]:
    """root/base (a random model with a tokenizer) and root/<name> for each of ``adapters``
    (ADAPTERS by default)."""
    import peft
    import transformers

    from tinyserve.engine.loading.demo import write_tokenizer

    torch.manual_seed(seed)
    base = root / "base"
    model_cls = transformers.AutoModelForCausalLM
    hf = model_cls.from_config(config).eval()
    hf.save_pretrained(base)
    write_tokenizer(base)
    paths = {"base": base}
    for i, (name, spec) in enumerate((adapters or ADAPTERS).items()):
        torch.manual_seed(seed + 1 + i)
        m = model_cls.from_pretrained(base)
        pm = peft.get_peft_model(m, peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.mul_(3.0)
        pm.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def peft_model(base_model, adapter_dir: Path | None):
    """The reference: a copy of transformers' model with the adapter applied by PEFT (None:
    the model as is). A copy: PEFT injects its layers into the model it is given."""
    import copy

    import peft

    if adapter_dir is None:
        return base_model
    return peft.PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter_dir)).eval()


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] log-softmax of the logits after each prompt position (fp32)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
