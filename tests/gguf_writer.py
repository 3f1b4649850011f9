"""Test helper: a transformers model written as llama.cpp's converter writes it (GGUF, with
the ``gguf`` package), in any of the types the tests need.

gguf-py quantizes F16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; Q4_K and Q6_K are packed here, by
round-to-nearest, in llama.cpp's block layouts (the weights need not be good, only exactly the
bytes the format defines: the references dequantize the same bytes).

What llama.cpp's convert_hf_to_gguf.py does that a reader must undo, and this writer does:
llama's q / k rows permuted for its rope; Gemma's norm weights stored as 1 + w; Phi-3 keeps its
fused qkv_proj and gate_up_proj (as attn_qkv, ffn_up).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

gguf = __import__("pytest").importorskip("gguf")
Q = gguf.GGMLQuantizationType

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


# ---- K-quant packers (one row of 256-blocks at a time, vectorized over rows) -------------

def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] float32 -> [rows, K / 256 * 144] uint8."""
    rows, k = w.shape
    x = w.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mn = (hi - lo) / 15, -lo  # per sub-block
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    m = np.clip(np.round(np.divide(mn, dminf, out=np.zeros_like(mn), where=dminf > 0)), 0, 63)
    step, off = (df * sc)[..., None], (dminf * m)[..., None]
    q = np.clip(np.round(np.divide(x + off, step, out=np.zeros_like(x), where=step > 0)), 0, 15)
    sc, m, q = sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)
    s = np.zeros((rows, k // 256, 12), np.uint8)
    s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    qs = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    out = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2),
                          dmin.view(np.uint8).reshape(rows, -1, 2), s,
                          qs.reshape(rows, k // 256, 128)], axis=-1)
    return out.reshape(rows, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] float32 -> [rows, K / 256 * 210] uint8."""
    rows, k = w.shape
    x = w.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(rows, k // 256, 2, 4, 32)  # [half, quarter, l]
    ql = np.stack([(q[..., 0, :] & 0xF) | ((q[..., 2, :] & 0xF) << 4),
                   (q[..., 1, :] & 0xF) | ((q[..., 3, :] & 0xF) << 4)], axis=-2)
    qh = ((q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4)
          | ((q[..., 3, :] >> 4) << 6))
    out = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
                          sc.astype(np.int8).view(np.uint8).reshape(rows, -1, 16),
                          d.view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    return out.reshape(rows, -1)


def encode(w: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """(the bytes or values to add_tensor, the raw dtype) of a float32 [rows, K] tensor."""
    w = np.ascontiguousarray(w, np.float32)
    if qtype == Q.F32:
        return w, None
    if qtype == Q.Q4_K:
        return pack_q4_k(w), Q.Q4_K
    if qtype == Q.Q6_K:
        return pack_q6_k(w), Q.Q6_K
    return gguf.quants.quantize(w, qtype), qtype


# ---- a model ------------------------------------------------------------------------------

def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two halves interleaved, pair by pair."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_model(hf, tokenizer_dir: Path, path: Path, qtype=Q.F32, types: dict | None = None,
                name: str = "test model") -> Path:
    """``hf``: a transformers model; ``types``: tensor name -> type, over ``qtype``. Norms,
    biases and 1-D tensors stay F32, as llama.cpp keeps them."""
    cfg = hf.config
    arch = ARCH[cfg.model_type]
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    Dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters) if gemma \
        else cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_dimension_count(int(Dh * rope.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if getattr(cfg, "sliding_window", None) and arch in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    _tokenizer(w, tokenizer_dir, cfg)

    def put(gguf_name: str, values: np.ndarray, default=qtype) -> None:
        if values.ndim == 1:  # norms and biases: F32
            w.add_tensor(gguf_name, values.astype(np.float32))
            return
        data, raw = encode(values, (types or {}).get(gguf_name, default))
        w.add_tensor(gguf_name, data, raw_dtype=raw)  # (quantized: [rows, bytes] uint8)

    def norm(v: np.ndarray) -> np.ndarray:
        return v + 1.0 if gemma else v

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    put("output_norm.weight", norm(sd["model.norm.weight"]))
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", norm(sd[p + "input_layernorm.weight"]))
        if arch == "phi3":
            put(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
        else:
            q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
            if arch == "llama":
                q, k = _permute(q, H), _permute(k, Hk)
            put(b + "attn_q.weight", q)
            put(b + "attn_k.weight", k)
            put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
            for x in ("q", "k", "v"):
                if p + f"self_attn.{x}_proj.bias" in sd:
                    put(b + f"attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"])
            put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
            put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        if p + "self_attn.q_norm.weight" in sd:
            put(b + "attn_q_norm.weight", norm(sd[p + "self_attn.q_norm.weight"]))
            put(b + "attn_k_norm.weight", norm(sd[p + "self_attn.k_norm.weight"]))
        if gemma:
            put(b + "post_attention_norm.weight", norm(sd[p + "post_attention_layernorm.weight"]))
            put(b + "ffn_norm.weight", norm(sd[p + "pre_feedforward_layernorm.weight"]))
            put(b + "post_ffw_norm.weight", norm(sd[p + "post_feedforward_layernorm.weight"]))
        else:
            put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tokenizer(w, tokenizer_dir: Path, cfg) -> None:
    """The directory's tokenizer.json as llama.cpp stores it: byte-level BPE as a gpt2-type
    vocabulary, SentencePiece-style BPE (byte fallback) as a llama-type one; tokens in id order,
    merges, CONTROL types for the added special tokens (BYTE for <0x..>)."""
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(specials)
    tokens = [""] * cfg.vocab_size
    for t, i in vocab.items():
        if i < cfg.vocab_size:
            tokens[i] = t
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    sentencepiece = bool(tj["model"].get("byte_fallback"))  # "▁" pieces and <0x..> bytes
    w.add_tokenizer_model("llama" if sentencepiece else "gpt2")
    if not sentencepiece:
        w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials or t.startswith("[PAD") else
                       6 if sentencepiece and t.startswith("<0x") else 1 for t in tokens])
    if sentencepiece:
        w.add_token_scores([-float(i) for i in range(len(tokens))])
    if merges:
        w.add_token_merges(merges)
    tc = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        if tc.get(key) in vocab:
            add(vocab[tc[key]])
    w.add_add_bos_token(bool(tc.get("add_bos_token")))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


# ---- small files with no transformers model behind them (the fuzzer's seeds) -------------

V = gguf.GGUFValueType
TINY = dict(D=8, I=16, Hq=2, Hk=1, Dh=4)  # hidden, ffn, query heads, kv heads, head size
_PIECES = ["▁", *"abcdehilnorstuw", "▁t", "▁th", "▁the", "he", "in", "▁a", "an", "er", "on",
           "re", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell", "▁hello", "st"]
_GPT2_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ w", "o r",
                "Ġw or", "l d", "Ġwor ld", "l l", "Ġ h", "Ġh e", "Ġhe ll", "Ġhell o"]


def _sentencepiece_vocab(gemma: bool) -> dict[str, tuple]:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(0, 256, 8)] + ["<tool>"] + _PIECES
    types = [3] * len(specials) + [6] * 32 + [4] + [1] * len(_PIECES)
    types[3 if gemma else 0] = 2
    ids = dict(bos=2, eos=1, unknown=3, padding=0) if gemma else dict(bos=1, eos=2, unknown=0)
    return {"tokenizer.ggml.model": ("llama", V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY),
            "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
            "tokenizer.ggml.scores": ([0.0] * (len(tokens) - len(_PIECES))
                                      + [-float(i) for i in range(len(_PIECES))], V.ARRAY),
            **{f"tokenizer.ggml.{k}_token_id": (i, V.UINT32) for k, i in ids.items()},
            "tokenizer.ggml.add_bos_token": (True, V.BOOL)}


def _gpt2_vocab() -> dict[str, tuple]:
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(256, 324)]  # (Ġ: 288)
    merged = ["".join(m.split(" ")) for m in _GPT2_MERGES]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + specials
    return {"tokenizer.ggml.model": ("gpt2", V.STRING),
            "tokenizer.ggml.pre": ("llama-bpe", V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY),
            "tokenizer.ggml.token_type": ([1] * (len(tokens) - 3) + [3] * 3, V.ARRAY, V.INT32),
            "tokenizer.ggml.merges": (_GPT2_MERGES, V.ARRAY),
            "tokenizer.ggml.bos_token_id": (len(tokens) - 2, V.UINT32),
            "tokenizer.ggml.eos_token_id": (len(tokens) - 1, V.UINT32),
            "tokenizer.ggml.eot_token_id": (len(tokens) - 3, V.UINT32),
            "tokenizer.chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}",
                                        V.STRING)}


def tiny_metadata(arch: str, tokenizer: str, layers: int) -> dict[str, tuple]:
    """key -> (value, GGUFValueType[, array item type]) of a tiny model's file."""
    t = TINY
    meta = {f"{arch}.{k}": v for k, v in {
        "block_count": (layers, V.UINT32), "context_length": (64, V.UINT32),
        "embedding_length": (t["D"], V.UINT32), "feed_forward_length": (t["I"], V.UINT32),
        "attention.head_count": (t["Hq"], V.UINT32),
        "attention.head_count_kv": (t["Hk"], V.UINT32),
        "attention.key_length": (t["Dh"], V.UINT32),
        "attention.value_length": (t["Dh"], V.UINT32),
        "rope.freq_base": (10000.0, V.FLOAT32),
        "rope.dimension_count": (t["Dh"] // 2 if arch == "phi3" else t["Dh"], V.UINT32),
        "attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32)}.items()}
    if arch in ("gemma2", "gemma3", "phi3"):
        meta[f"{arch}.attention.sliding_window"] = (4, V.UINT32)
    if arch == "gemma3":
        meta["gemma3.attention.sliding_window_pattern"] = (
            [i % 2 == 0 for i in range(layers)], V.ARRAY, V.BOOL)
    vocab = _gpt2_vocab() if tokenizer == "gpt2" else _sentencepiece_vocab(arch.startswith("gemma"))
    return {"general.name": ("tiny", V.STRING), **meta, **vocab}


def tiny_tensors(arch: str, vocab: int, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The family's tensors, as llama.cpp names them, [rows, row length] F32."""
    t, g = TINY, np.random.default_rng(seed)
    D, I, q, kv = t["D"], t["I"], t["Hq"] * t["Dh"], t["Hk"] * t["Dh"]
    shapes = {"token_embd.weight": (vocab, D), "output_norm.weight": (D,)}
    if arch == "llama":
        shapes["output.weight"] = (vocab, D)
    for i in range(layers):
        b = f"blk.{i}."
        layer = {"attn_norm": (D,), "attn_output": (D, q), "ffn_norm": (D,), "ffn_down": (D, I)}
        if arch == "phi3":
            layer.update(attn_qkv=(q + 2 * kv, D), ffn_up=(2 * I, D))
        else:
            layer.update(attn_q=(q, D), attn_k=(kv, D), attn_v=(kv, D), ffn_gate=(I, D),
                         ffn_up=(I, D))
        if arch in ("qwen3", "gemma3"):
            layer.update(attn_q_norm=(t["Dh"],), attn_k_norm=(t["Dh"],))
        if arch.startswith("gemma"):
            layer.update(post_attention_norm=(D,), post_ffw_norm=(D,))
        shapes.update({f"{b}{n}.weight": s for n, s in layer.items()})
        if arch == "qwen2":
            shapes.update({f"{b}attn_{x}.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))})
    return {n: (g.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items()}


def write_tiny(path: Path, arch: str = "llama", tokenizer: str = "sentencepiece",
               layers: int = 1, meta: dict | None = None) -> Path:
    """A small valid model file (F32, hidden 8) with a small tokenizer: ``sentencepiece``
    (scored pieces, merges rebuilt from the scores) or ``gpt2`` (byte-level, with merges).
    ``meta``: keys over the defaults, key -> (value, type[, item type]); None drops a key."""
    kv = {**tiny_metadata(arch, tokenizer, layers), **(meta or {})}
    w = gguf.GGUFWriter(str(path), arch)
    for key, spec in kv.items():
        if spec is not None:
            w.add_key_value(key, *spec)
    vocab = len(kv["tokenizer.ggml.tokens"][0])
    for name, values in tiny_tensors(arch, vocab, layers).items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- raw bytes, for files no writer writes ------------------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: ``payload`` is the value's bytes as the file holds them."""
    return gstr(key) + struct.pack("<I", vtype) + payload


def array(item: int, count: int, items: bytes) -> bytes:
    return struct.pack("<IQ", item, count) + items


def tensor_info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return gstr(name) + struct.pack("<I", len(dims)) + b"".join(
        struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset)


def raw_file(path: Path, kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"",
             counts: tuple[int, int] | None = None) -> Path:
    """A GGUF v3 file of these entries (``counts``: the header's tensor and key counts, if
    they are to lie), the data at 32 bytes after them."""
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(head + bytes(-len(head) % 32) + data)
    return path
