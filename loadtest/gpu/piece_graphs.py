"""(c) CUDA-graph replay against eager: a random-weight GQA Llama (bf16 on the device) written
as a checkpoint, served through DeviceEngine twice, with and without enforce_eager; the greedy
tokens of a batch of prompts must be identical (padded rows never change a real row's numbers),
and one prompt alone must equal itself in the batch. On the CPU the decode buckets' recorded
launch lists are replayed instead of CUDA graphs (the same recordings a GPU captures).
"""

from __future__ import annotations

import gc
import random
import time

import checklib as L


def run(piece: L.Piece, P: dict, ctx) -> None:
    from tinyserve.engine.device import select_device

    dev = select_device(ctx.device)
    import torch

    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine

    dims, n = P["model"], P["tokens"]
    model_dir = ctx.work / "graphs-model"
    info = L.write_checkpoint(model_dir, dims, P["dtype"], dev, seed=1)
    piece.info(model={k: dims[k] for k in ("hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads",
                                           "head_dim", "vocab_size")},
               dtype=P["dtype"], checkpoint_s=info["seconds"])
    rng = random.Random(0)
    V = dims["vocab_size"] - 300  # (clear of the specials)
    prompts = [[rng.randrange(V) for _ in range(5 + (37 * i) % 61)] for i in range(P["prompts"])]
    blocks = P["prompts"] * (-(-(max(map(len, prompts)) + n + 1) // 16)) + 16
    outs, alone, meta = {}, None, {}
    for eager in (True, False):
        t0 = time.perf_counter()
        cfg = EngineConfig(model=str(model_dir), dtype=P["dtype"], device=dev,
                           enforce_eager=eager, max_num_seqs=max(8, P["prompts"]),
                           num_kv_blocks=blocks, max_model_len=P["max_model_len"])
        engine = DeviceEngine(cfg)
        outs[eager] = L.engine_generate(engine, cfg, prompts, n)
        if not eager:
            alone = L.engine_generate(engine, cfg, [prompts[0]], n)[0]
            meta = {"use_graphs": engine.runner.buckets.use_graphs,
                    "recorded_buckets": sorted(engine.runner.buckets.recorded)}
        meta[f"{'eager' if eager else 'buckets'}_s"] = round(time.perf_counter() - t0, 1)
        del engine
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    piece.info(**meta)
    t = piece.table("greedy tokens per prompt", ["prompt", "prompt tokens", "eager == graphs",
                                                 "first 8 tokens (graphs)"])
    equal = 0
    for i, p in enumerate(prompts):
        same = outs[True][i] == outs[False][i]
        equal += same
        piece.row(t, [i, len(p), same, list(outs[False][i][:8])])
    path = "CUDA graphs" if dev == "cuda" else "recorded-launch replay"
    piece.check(f"greedy outputs: {path} == eager, every prompt", equal == len(prompts),
                value=f"{equal}/{len(prompts)}")
    piece.check("prompt 0 alone == prompt 0 in the batch (decode buckets)",
                alone == outs[False][0], value=list(alone[:8]))
    piece.check("the decode steps took the bucket path", bool(meta.get("recorded_buckets")),
                value=meta.get("recorded_buckets"))
    if dev == "cuda":
        piece.check("the buckets replay as CUDA graphs", meta.get("use_graphs") is True)
    else:
        piece.check("the buckets replay as CUDA graphs", skipped="no CUDA on the CPU: the "
                    "buckets' recorded launch lists are replayed instead (the CPU equivalent)")
