"""The built-in demo checkpoint: a tiny random-weight Llama with a byte-level tokenizer.

``python -m tinyserve`` with no ``--model`` serves this, so the server starts on a fresh
machine with no downloads. It is deterministic (same bytes everywhere), written once into a
cache directory, and its output is noise: the logs say so.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from tinyserve.models import default_cache_dir

log = logging.getLogger(__name__)

DEMO_VERSION = 1
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def build_byte_tokenizer():
    """Byte-level BPE without merges: ids 0-255 are bytes, then <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)])
    return tok


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, others to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_tokenizer(model_dir: Path, chat_template: str = DEMO_CHAT_TEMPLATE) -> None:
    build_byte_tokenizer().save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": True, "chat_template": chat_template}, indent=2))


def write_random_llama(model_dir: Path, config: dict, seed: int = 0, std: float = 0.05) -> None:
    """A random-weight Llama checkpoint in Hugging Face layout (config + safetensors)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    D, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, Hk = config["num_attention_heads"], config["num_key_value_heads"]
    Dh = config.get("head_dim") or D // H

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    tensors = {"model.embed_tokens.weight": rnd(V, D), "model.norm.weight": 1 + rnd(D)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + rnd(D),
            p + "post_attention_layernorm.weight": 1 + rnd(D),
            p + "self_attn.q_proj.weight": rnd(H * Dh, D),
            p + "self_attn.k_proj.weight": rnd(Hk * Dh, D),
            p + "self_attn.v_proj.weight": rnd(Hk * Dh, D),
            p + "self_attn.o_proj.weight": rnd(D, H * Dh),
            p + "mlp.gate_proj.weight": rnd(I, D),
            p + "mlp.up_proj.weight": rnd(I, D),
            p + "mlp.down_proj.weight": rnd(D, I),
        })
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = rnd(V, D)
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Path of the demo checkpoint, creating it (atomically) on first use."""
    target = (cache_dir or default_cache_dir()) / f"demo-llama-v{DEMO_VERSION}"
    if (target / "model.safetensors").exists():
        log.warning("serving the built-in DEMO model (random weights, output is noise): %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_random_llama(tmp, DEMO_CONFIG, seed=DEMO_VERSION)
        write_tokenizer(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its copy
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("created the built-in DEMO model (random weights, output is noise): %s", target)
    return target
