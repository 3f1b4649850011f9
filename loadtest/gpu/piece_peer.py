"""(e) The peer: the same decode workload through transformers' LlamaForCausalLM (random
weights, the same shapes and dtype, SDPA attention), plain ``generate`` with its default
dynamic cache, greedy, no EOS. ms/step = (time for 1 + N new tokens - time for 1) / N: the
prefill cancels out. Batches and prompt length as in (d).
"""

from __future__ import annotations

import gc
import time

import checklib as L


def run(piece: L.Piece, P: dict, ctx) -> None:
    from tinyserve.engine.device import select_device

    dev = select_device(ctx.device)
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    dims, N = P["model"], P["new_tokens"]
    dtype = getattr(torch, P["dtype"])
    cfg = LlamaConfig(**{k: dims[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
        "max_position_embeddings")}, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the model dtype, on the device
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    piece.info(transformers=transformers.__version__, init_s=round(time.perf_counter() - t0, 1),
               attention="sdpa", cache="DynamicCache (plain generate)", dtype=P["dtype"])

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def gen(ids, n):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - t, out

    t = piece.table("decode steps", ["batch", "prompt", "ms/step", "prefill + first token ms"])
    g = torch.Generator(device="cpu").manual_seed(7)
    finite, lengths = True, True
    for B in P["batches"]:
        if ctx.deadline.over(10):
            piece.check(f"batch {B}", skipped="out of the piece's budget")
            continue
        ids = torch.randint(0, dims["vocab_size"], (B, P["prompt"]), generator=g).to(dev)
        gen(ids, 2)  # warm-up
        t1, _ = gen(ids, 1)
        tn, out = gen(ids, N + 1)
        lengths &= out.shape == (B, P["prompt"] + N + 1)
        piece.row(t, [B, P["prompt"], round((tn - t1) / N * 1e3, 3), round(t1 * 1e3, 2)])
        with torch.inference_mode():
            logits = model(ids[:1, :16]).logits
        finite &= bool(torch.isfinite(logits).all())
        del ids, out, logits
        gc.collect()
    piece.check("every generate returned prompt + N tokens", lengths)
    piece.check("the peer's logits are finite", finite)
