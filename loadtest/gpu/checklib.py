"""What the pieces of the device check (``check.py``) share: the sizes of every piece on the
H200 and in the CPU dry run, the result file a piece writes as it goes, the random checkpoint
and the byte-level BPE tokenizer written for the served models, and a few numeric helpers.

Imported by ``check.py`` (no torch at import: the orchestrator stays light) and by each piece
in its own process.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository

# Llama-3-8B's shapes, as a Hugging Face config (random weights are written or built from it).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                 rope_theta=500000.0, max_position_embeddings=8192)
# The dry run's stand-in: every piece's code path at toy sizes (GQA 2:1, a partial int4 group).
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=10000.0,
            max_position_embeddings=2048)

# Piece budgets in seconds (the subprocess's timeout) and what each runs. On the H200 the whole
# run must end inside 540 s (one device command may take 600 s; the machine's start, 1-3 min,
# comes on top, out of a 15-minute lease). See docs/results.md, "H200 (device check)".
DEVICE = {
    "total_s": 540,
    "budgets": {"install": 30, "kernel_tests": 150, "stories260k": 50, "graphs_vs_eager": 40,
                "decode_8b": 150, "transformers_peer": 45, "server_e2e": 45},
    "server_prep_s": 330,  # writing the 16 GB checkpoint, then the server's load + warm-up
    "kernel_tests": dict(workers=12, paths=["tests/kernels"],
                         extra=["--ignore=tests/kernels/test_gpu_compile.py", "--maxfail=10"]),
    "stories260k": dict(tokens=48, dtypes=["float32", "float16", "bfloat16"]),
    "graphs_vs_eager": dict(model=dict(hidden_size=2048, intermediate_size=5632,
                                       num_hidden_layers=4, num_attention_heads=16,
                                       num_key_value_heads=4, head_dim=128, vocab_size=32000,
                                       rope_theta=500000.0, max_position_embeddings=4096),
                            dtype="bfloat16", prompts=8, tokens=32, max_model_len=512),
    "decode_8b": dict(model=LLAMA3_8B, dtype="bfloat16", formats=["float", "int8", "int4"],
                      batches=[1, 16, 64], prompt=512, max_model_len=1024, warm=3, steps=10,
                      kernel_m=[1, 64], attention=[[64, 4096], [16, 32768]], sample_b=[1, 64]),
    "transformers_peer": dict(model=LLAMA3_8B, dtype="bfloat16", batches=[1, 16, 64],
                              prompt=512, new_tokens=32),
    "server_e2e": dict(model=LLAMA3_8B, dtype="bfloat16", clients=64, requests=128,
                       max_tokens=128, prompt_words=64, max_model_len=1024, num_kv_blocks=4160,
                       max_num_seqs=64),
}

DRY = {
    "total_s": 600,
    "budgets": {"install": 60, "kernel_tests": 120, "stories260k": 120, "graphs_vs_eager": 90,
                "decode_8b": 150, "transformers_peer": 90, "server_e2e": 120},
    "server_prep_s": 240,
    "kernel_tests": dict(workers=1, paths=["tests/kernels/test_matmul.py",
                                           "tests/kernels/test_elementwise.py"],
                         extra=["-k", "silu_and_mul or (test_matmul and 64-64)", "--maxfail=10"]),
    "stories260k": dict(tokens=6, dtypes=["float32", "float16"]),
    "graphs_vs_eager": dict(model=TINY, dtype="float32", prompts=3, tokens=4, max_model_len=256),
    "decode_8b": dict(model=TINY, dtype="float32", formats=["float", "int8", "int4"],
                      batches=[1, 4], prompt=16, max_model_len=256, warm=1, steps=1,
                      kernel_m=[1, 4], attention=[[4, 256], [2, 1024]], sample_b=[1, 4]),
    "transformers_peer": dict(model=TINY, dtype="float32", batches=[1, 4], prompt=16,
                              new_tokens=4),
    "server_e2e": dict(model=TINY, dtype="float32", clients=4, requests=4, max_tokens=4,
                       prompt_words=8, max_model_len=256, num_kv_blocks=64, max_num_seqs=4),
}

PIECES = ["kernel_tests", "stories260k", "graphs_vs_eager", "decode_8b", "transformers_peer",
          "server_e2e"]
TITLES = {
    "install": "install (wheels + project, no network)",
    "kernel_tests": "(a) kernel tests on the device",
    "stories260k": "(b) stories260k vs reference.json",
    "graphs_vs_eager": "(c) CUDA-graph replay vs eager",
    "decode_8b": "(d) decode at Llama-3-8B shapes",
    "transformers_peer": "(e) transformers peer",
    "server_e2e": "(f) server end to end",
}


def params(dry: bool) -> dict:
    return DRY if dry else DEVICE


# -- a piece's result, rewritten as it goes (a piece killed at its budget keeps what it had) ---

class Piece:
    """One piece's checks, tables and notes, saved to ``path`` (JSON) after every change."""

    def __init__(self, name: str, path: str | Path, dry: bool) -> None:
        self.path = Path(path)
        self.dry = dry
        self.data = {"name": name, "status": "running", "reason": None, "checks": [],
                     "tables": {}, "notes": [], "info": {}}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def check(self, name: str, ok: bool | None = None, value=None, limit=None,
              skipped: str | None = None) -> bool:
        """A pass/fail line; ``skipped``: not run here, and why."""
        entry = {"name": name, "ok": None if skipped else bool(ok), "value": value,
                 "limit": limit}
        if skipped:
            entry["skipped"] = skipped
        self.data["checks"].append(entry)
        self.save()
        return bool(ok)

    def table(self, title: str, columns: list[str]) -> str:
        self.data["tables"].setdefault(title, {"columns": columns, "rows": []})
        self.save()
        return title

    def row(self, title: str, values: list) -> None:
        self.data["tables"][title]["rows"].append(values)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def info(self, **kw) -> None:
        self.data["info"].update(kw)
        self.save()

    def finish(self, status: str | None = None, reason: str | None = None) -> None:
        if status is None:
            checks = self.data["checks"]
            failed = [c for c in checks if c["ok"] is False]
            status = "failed" if failed else "ok"
            if failed and reason is None:
                reason = "failed: " + ", ".join(c["name"] for c in failed[:5])
            elif checks and all(c["ok"] is None for c in checks):  # nothing could run
                status = "skipped"
                reason = reason or "; ".join(dict.fromkeys(c["skipped"] for c in checks))
        self.data["status"], self.data["reason"] = status, reason
        self.save()

    def fail(self, exc: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        self.note("exception: " + tb[-3000:])
        self.finish("failed", f"{type(exc).__name__}: {exc}"[:500])


class Deadline:
    """The piece's own end (a little before the orchestrator kills it)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def over(self, need: float = 0.0) -> bool:
        return self.left() < need


# -- numbers --------------------------------------------------------------------------------

def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    import torch

    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


REL_L2_LIMIT = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 1.5e-2}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


# -- models on disk: random Llama checkpoints and a byte-level BPE tokenizer -----------------

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly ``vocab_size`` tokens, built without training: ids 0-255
    are the bytes, then merges (every byte pair, common letters first, then byte triples),
    then <|begin_of_text|>, <|end_of_text|> and (for a Llama-3-sized vocabulary) 254 reserved
    specials, as Llama 3 lays its 128,256 tokens out. -> (tokenizer, bos id, eos id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    reserved = 254 if vocab_size >= 100_000 else 0
    specials = list(SPECIALS) + [f"<|reserved_special_token_{i}|>" for i in range(reserved)]
    n_merges = vocab_size - 256 - len(specials)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is under 256 bytes + {len(specials)} specials")
    first = " etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ0123456789.,'\"!?-:;()"
    order = [ord(c) for c in first] + [b for b in range(256) if chr(b) not in first]
    syms = [table[b] for b in order]
    vocab = {table[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    pairs = sorted(((a, b) for a in range(256) for b in range(256)),
                   key=lambda p: (max(p), p[0], p[1]))  # (by rank: common letters first)
    for a, b in pairs:
        if len(merges) == n_merges:
            break
        merges.append((syms[a], syms[b]))
    for a, b in pairs:
        for c in range(256):
            if len(merges) >= n_merges:
                break
            merges.append((syms[a] + syms[b], syms[c]))
        if len(merges) >= n_merges:
            break
    for left, right in merges:
        vocab[left + right] = len(vocab)
    assert len(vocab) == 256 + n_merges, "merge tokens must be distinct"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok, tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])


def write_tokenizer(model_dir: Path, vocab_size: int) -> tuple[int, int]:
    from tinyserve.engine.loading.demo import DEMO_CHAT_TEMPLATE

    tok, bos, eos = build_tokenizer(vocab_size)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1], "add_bos_token": True, "chat_template": DEMO_CHAT_TEMPLATE},
        indent=1))
    return bos, eos


def hf_config(dims: dict, dtype: str, bos: int, eos: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype}


def write_checkpoint(model_dir: Path, dims: dict, dtype: str, device: str, seed: int = 0,
                     std: float = 0.02, shard_layers: int = 8) -> dict:
    """A random Llama checkpoint in Hugging Face layout (config.json, safetensors shards with an
    index, the BPE tokenizer), its tensors drawn on ``device`` in ``dtype``. -> timings."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model_dir.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(model_dir, dims["vocab_size"])
    t_tok = time.perf_counter() - t0
    dt = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    D, I, V = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    H, Hk, Dh = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]

    def rnd(*shape, base=0.0):
        x = torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std + base
        return x.to(dt).cpu().contiguous()

    L = dims["num_hidden_layers"]
    groups = [list(range(i, min(L, i + shard_layers))) for i in range(0, L, shard_layers)]
    weight_map, nbytes = {}, 0
    for s, layers in enumerate(groups + [None]):
        tensors = {}
        if layers is None:  # the last shard: embedding, final norm, LM head
            tensors = {"model.embed_tokens.weight": rnd(V, D),
                       "model.norm.weight": rnd(D, base=1.0), "lm_head.weight": rnd(V, D)}
        else:
            for i in layers:
                p = f"model.layers.{i}."
                tensors.update({
                    p + "input_layernorm.weight": rnd(D, base=1.0),
                    p + "post_attention_layernorm.weight": rnd(D, base=1.0),
                    p + "self_attn.q_proj.weight": rnd(H * Dh, D),
                    p + "self_attn.k_proj.weight": rnd(Hk * Dh, D),
                    p + "self_attn.v_proj.weight": rnd(Hk * Dh, D),
                    p + "self_attn.o_proj.weight": rnd(D, H * Dh),
                    p + "mlp.gate_proj.weight": rnd(I, D),
                    p + "mlp.up_proj.weight": rnd(I, D),
                    p + "mlp.down_proj.weight": rnd(D, I)})
        name = f"model-{s + 1:05d}-of-{len(groups) + 1:05d}.safetensors"
        save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            nbytes += v.numel() * v.element_size()
        del tensors
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes}, "weight_map": weight_map}))
    (model_dir / "config.json").write_text(json.dumps(hf_config(dims, dtype, bos, eos), indent=1))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos}))
    return {"bytes": nbytes, "seconds": round(time.perf_counter() - t0, 2),
            "tokenizer_seconds": round(t_tok, 2), "bos": bos, "eos": eos}


# -- generation through the engine (what LLM.generate does, without LLM's warm-up) -----------

def engine_generate(engine, config, prompts: list[list[int]], max_tokens: int,
                    ignore_eos: bool = True) -> list[tuple[int, ...]]:
    """Greedy ``max_tokens`` for each prompt, batched, through EngineCore's step loop and the
    engine's ModelRunner.execute: LLM.generate's loop. LLM itself is not used because its
    warm-up compiles every sampling variant at every bucket (minutes of Triton compiles on a
    cold cache); here only what the greedy steps launch is compiled, and a decode bucket is
    recorded (captured as a CUDA graph on a GPU) on first use."""
    from tinyserve.core.engine_core import CoreConfig, EngineCore
    from tinyserve.messages import SamplingParams

    core = EngineCore(CoreConfig.from_engine(config, engine.info), engine.tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    ids = [core.add_request(i, list(p), params).request_id for i, p in enumerate(prompts)]
    try:
        while core.has_unfinished:
            plan = core.schedule()
            if plan is None:
                raise RuntimeError("scheduler made no progress with work pending")
            core.process(plan, engine.runner.execute(plan))
        return [tuple(core.release(i).seq.output_token_ids) for i in ids]
    finally:
        for i in ids:
            core.release(i)
