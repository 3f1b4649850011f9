"""(d) Decode at Llama-3-8B shapes with random weights (bf16; int8 and int4 weights made from
them): each kernel's time and achieved bandwidth against the device-to-device copy bandwidth
measured first, each beside a check of its output against torch (relative L2), then ms per
decode step at batch 1 / 16 / 64, eager and through the decode buckets (CUDA graphs), with the
two paths' tokens compared.

The model is built in memory (no checkpoint: the loader would quantize 8B weights on the CPU)
from tinyserve.engine's building blocks - ModelConfig, LayerWeights / Linear / ModelWeights,
quantize_int8 / quantize_int4_linear, DecoderModel, rope_tables, KVCacheSpec and the
ModelRunner constructor - and driven only through ModelRunner.execute(StepPlan): a chunked
prefill of every sequence (the KV cache holds real keys, not zeros), then decode steps.
Nothing times zeros: weights, activations, KV and logits are random.
"""

from __future__ import annotations

import gc
import math
import time

import checklib as L

SAMPLE_PASSES = {"greedy": 1, "top-k + top-p": 1 + 8 + 1 + 8 + 1}  # kernels/sampling.py's passes
KV_NOTE = ("KV bytes: each sequence's keys and values read once (int8: codes + fp16 scales)")


def model_config(dims: dict, dtype: str, max_len: int):
    from tinyserve.engine.loading.model_config import ModelConfig

    return ModelConfig(vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
                       intermediate_size=dims["intermediate_size"],
                       num_layers=dims["num_hidden_layers"], num_heads=dims["num_attention_heads"],
                       num_kv_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"],
                       rms_norm_eps=1e-5, rope_theta=dims["rope_theta"], rope_scaling=None,
                       max_position_embeddings=max_len, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_ids=(), torch_dtype=dtype)


def float_weights(cfg, dtype, dev, seed: int = 0):
    import torch

    from tinyserve.engine.model.weights import LayerWeights, Linear, ModelWeights

    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, base=0.0):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02 + base).to(dtype)

    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [LayerWeights(rnd(D, base=1.0), Linear(rnd(q + 2 * kv, D)), Linear(rnd(D, q)),
                           rnd(D, base=1.0), Linear(rnd(2 * I, D)), Linear(rnd(D, I)))
              for _ in range(cfg.num_layers)]
    return ModelWeights(rnd(V, D), layers, rnd(D, base=1.0), Linear(rnd(V, D)))


def quantized(base, fmt: str, dtype):
    """The same model with its decoder linears quantized on the device (the LM head and the
    embedding stay in the model dtype, as the loader keeps them)."""
    from dataclasses import replace

    from tinyserve.engine.loading.quantize import quantize_int4_linear, quantize_int8
    from tinyserve.engine.model.weights import ModelWeights

    def q(lin):
        return quantize_int8(lin.weight) if fmt == "int8" else \
            quantize_int4_linear(lin.weight, dtype)

    layers = [replace(ly, qkv=q(ly.qkv), o=q(ly.o), gate_up=q(ly.gate_up), down=q(ly.down))
              for ly in base.layers]
    return ModelWeights(base.embed, layers, base.norm, base.lm_head, quantization=fmt)


def dequantized(lin):
    """A linear's weight as fp32 [out, in]: the reference the kernels are checked against."""

    from tinyserve.engine.model.weights import Int4Linear
    from tinyserve.kernels.int4_pack import unpack_int4

    if isinstance(lin, Int4Linear):
        q = unpack_int4(lin.qweight).float()
        G = lin.group_size
        s = lin.scales.float().repeat_interleave(G, dim=1)
        z = 8.0 if lin.zeros is None else lin.zeros.float().repeat_interleave(G, dim=1)
        return ((q - z) * s)[:, : lin.in_features]
    w = lin.weight.float()
    return w * lin.scale.float()[:, None] if lin.scale is not None else w


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def lin_bytes(lin) -> int:
    return lin.nbytes


# -- the kernel table -------------------------------------------------------------------------

class Kernels:
    def __init__(self, piece, dev, dtype, gbps, timeit) -> None:
        import torch

        self.piece, self.dev, self.dtype, self.gbps, self.timeit = piece, dev, dtype, gbps, timeit
        self.esz = torch.tensor([], dtype=dtype).element_size()
        self.limit = L.REL_L2_LIMIT[str(dtype).removeprefix("torch.")]
        self.table = piece.table("kernels", ["kernel", "weights / KV", "shape", "triton ms",
                                             "torch ms", "GB/s", "% of copy", "error vs torch",
                                             "limit", "ok"])
        self.worst: dict[str, list] = {}

    def add(self, group, name, kind, shape, run, peer, nbytes_, error, limit) -> None:
        t = self.timeit(run, self.dev)
        tp = self.timeit(peer, self.dev) if peer is not None else float("nan")
        gbs = nbytes_ / t / 1e9
        ok = error <= limit
        self.piece.row(self.table, [name, kind, shape, round(t * 1e3, 4),
                                    round(tp * 1e3, 4) if tp == tp else None, round(gbs, 1),
                                    round(100 * gbs / self.gbps, 1), error, limit, ok])
        self.worst.setdefault(group, []).append((ok, name, kind, shape, error))

    def matmul(self, name, lin, kind, M) -> None:
        """``kind``: "float" (the model dtype), "int8" or "int4"."""
        import torch

        from tinyserve.engine.model.linear import linear

        ref_w = dequantized(lin)
        N, K = ref_w.shape
        a = torch.randn(M, K, device=self.dev).to(self.dtype)
        out = linear(a, lin)
        err = L.rel_l2(out.float(), a.float() @ ref_w.T)
        dense = lin.weight if kind == "float" else torch.randn(N, K, device=self.dev).to(self.dtype)
        shown = str(self.dtype).removeprefix("torch.") if kind == "float" else kind
        self.add(f"matmul ({shown})", name, shown, f"M={M} N={N} K={K}", lambda: linear(a, lin),
                 lambda: a @ dense.T, lin_bytes(lin) + (M * K + M * N) * self.esz, err,
                 self.limit)
        del ref_w

    def attention(self, B, ctx, Hq, Hk, Dh, int8: bool) -> None:
        import torch

        import tinyserve.kernels as K

        dev, bs = self.dev, 16
        nb = -(-ctx // bs)
        nblocks = B * nb + 1
        if int8:
            kc = torch.randint(-127, 128, (nblocks, bs, Hk, Dh), dtype=torch.int8, device=dev)
            vc = torch.randint(-127, 128, (nblocks, bs, Hk, Dh), dtype=torch.int8, device=dev)
            ks = (torch.rand(nblocks, bs, Hk, device=dev) * 0.02 + 0.002).half()
            vs = (torch.rand(nblocks, bs, Hk, device=dev) * 0.02 + 0.002).half()
        else:
            kc = torch.randn(nblocks, bs, Hk, Dh, device=dev).to(self.dtype)
            vc = torch.randn(nblocks, bs, Hk, Dh, device=dev).to(self.dtype)
            ks = vs = None
        table = torch.randperm(B * nb, device=dev).to(torch.int32).view(B, nb)
        g = torch.Generator(device="cpu").manual_seed(B * ctx)
        lens = (ctx - torch.randint(0, bs, (B,), generator=g)).to(torch.int32).to(dev)
        q = torch.randn(B, Hq, Dh, device=dev).to(self.dtype)

        def run():
            return K.token_attention_paged(q, kc, vc, table, lens, ctx, k_scale=ks, v_scale=vs)

        out = run()
        rows = sorted({0, B - 1})
        refs, gots = [], []
        for b in rows:
            n = int(lens[b])
            blk = table[b, : -(-n // bs)].long()
            kk = kc[blk].reshape(-1, Hk, Dh)[:n].float()
            vv = vc[blk].reshape(-1, Hk, Dh)[:n].float()
            if int8:
                kk = kk * ks[blk].reshape(-1, Hk)[:n].float()[..., None]
                vv = vv * vs[blk].reshape(-1, Hk)[:n].float()[..., None]
            rep = Hq // Hk
            kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
            s = torch.einsum("hd,thd->ht", q[b].float(), kk) * Dh ** -0.5
            refs.append(torch.einsum("ht,thd->hd", torch.softmax(s, -1), vv))
            gots.append(out[b].float())
        err = L.rel_l2(torch.stack(gots), torch.stack(refs))
        tokens = int(lens.sum())
        per_tok = Hk * Dh * (1 if int8 else self.esz) * 2 + (Hk * 2 * 2 if int8 else 0)
        moved = tokens * per_tok + 2 * B * Hq * Dh * self.esz + table.numel() * 4
        peer = None
        if not int8:  # torch's SDPA over the same keys made contiguous (GQA), for scale
            kt = kc[table.long()].reshape(B, nb * bs, Hk, Dh)[:, :ctx].transpose(1, 2).contiguous()
            vt = vc[table.long()].reshape(B, nb * bs, Hk, Dh)[:, :ctx].transpose(1, 2).contiguous()
            q4 = q[:, :, None, :]
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def peer():
                return sdpa(q4, kt, vt, enable_gqa=True)
        kind = "int8 KV" if int8 else f"{str(self.dtype).removeprefix('torch.')} KV"
        self.add(f"attention ({kind})", "decode attention (paged, split-KV)", kind,
                 f"B={B} ctx={ctx} Hq={Hq} Hk={Hk} Dh={Dh}", run, peer, moved, err, self.limit)

    def sampling(self, B, V) -> None:
        import torch

        import tinyserve.kernels as K

        dev = self.dev
        logits = torch.randn(B, V, device=dev) * 3
        temp = torch.full((B,), 0.8, device=dev)
        top_k = torch.full((B,), 50, device=dev, dtype=torch.int32)
        top_p = torch.full((B,), 0.9, device=dev)
        seeds = torch.arange(B, device=dev, dtype=torch.int64)
        lsm = torch.log_softmax(logits.double(), -1)
        for variant, greedy in (("greedy", True), ("top-k + top-p", False)):
            def run(greedy=greedy):
                return K.sample(logits, temp, top_k, top_p, seeds, all_greedy=greedy)

            tokens, lps, _, _ = run()
            lp_err = float((lps.double() - lsm.gather(1, tokens[:, None])[:, 0]).abs().max())
            if greedy:
                wrong = int((tokens != logits.argmax(-1)).sum())

                def peer():
                    return logits.argmax(-1)
            else:
                wrong = int((~_in_top_k_top_p(logits, tokens, 0.8, 50, 0.9)).sum())

                def peer():
                    z = logits / 0.8
                    v, i = z.topk(50, dim=-1)
                    p = torch.softmax(v, -1)
                    keep = (p.cumsum(-1) - p) < 0.9
                    p = torch.where(keep, p, 0)
                    return i.gather(1, torch.multinomial(p, 1))
            passes = SAMPLE_PASSES[variant]
            # error: the drawn tokens' largest logprob error, inf if a token is wrong (greedy:
            # not the argmax; sampled: outside the top-k / top-p set)
            self.add("sampling", f"sample ({variant}; {passes} pass{'es' * (passes > 1)} "
                     "over the logits)",
                     "fp32 logits", f"B={B} V={V}", run, peer, passes * B * V * 4,
                     lp_err if wrong == 0 else math.inf, 1e-3)


def _in_top_k_top_p(logits, tokens, temp, k, p):
    """Whether each drawn token is in the top-k, then top-p (HF / vLLM: the smallest set whose
    mass reaches p) set; a little slack at the boundaries for float rounding."""
    import torch

    z = logits.double() / temp
    kth = z.topk(k, dim=-1).values[:, -1:]
    kept = z >= kth - 1e-6 * kth.abs()
    e = torch.where(kept, torch.exp(z - z.max(-1, keepdim=True).values), 0.0)
    srt = e.sort(-1, descending=True).values
    n_keep = (srt.cumsum(-1) < p * (1 + 1e-6) * e.sum(-1, keepdim=True)).sum(-1) + 1
    cut = srt.gather(1, (n_keep - 1).clamp(max=k - 1)[:, None])
    tok_e = e.gather(1, tokens[:, None])
    return (kept.gather(1, tokens[:, None]) & (tok_e >= cut * (1 - 1e-6)))[:, 0]


# -- decode steps through the runner ----------------------------------------------------------

def drive(runner, prompts, batches, warm, steps, bs) -> tuple[list, dict]:
    """Prefill every prompt (plans of at most 2,048 tokens), then for each batch size B the
    first B sequences decode ``warm + steps`` steps; -> (rows of (B, median s, min s,
    mean context)), {seq: tokens}."""
    from tinyserve.messages import SamplingParams, ScheduledSeq, StepPlan

    S = len(prompts)
    nb = -(-(len(prompts[0]) + len(batches) * (warm + steps) + 1) // bs)
    greedy = SamplingParams(temperature=0.0)
    last, tokens, step = {}, {i: [] for i in range(S)}, 0
    per_plan = max(1, 2048 // len(prompts[0]))
    for g in range(0, S, per_plan):
        seqs = tuple(ScheduledSeq(i, tuple(prompts[i]), 0, tuple(range(i * nb, (i + 1) * nb)),
                                  True, greedy, 0) for i in range(g, min(S, g + per_plan)))
        for o in runner.execute(StepPlan(step, seqs)).outputs:
            last[o.seq_id] = o.token_id
        step += 1
    pos = {i: len(prompts[i]) for i in range(S)}
    rows = []
    for B in batches:
        times, ctxs = [], []
        for k in range(warm + steps):
            seqs = tuple(ScheduledSeq(i, (last[i],), pos[i], (), True, greedy, 0, first_block=nb)
                         for i in range(B))
            t = time.perf_counter()
            res = runner.execute(StepPlan(step, seqs))
            dt = time.perf_counter() - t
            step += 1
            for o in res.outputs:
                last[o.seq_id] = o.token_id
                tokens[o.seq_id].append(o.token_id)
            if k >= warm:
                times.append(dt)
                ctxs.append(sum(pos[i] + 1 for i in range(B)))
            for i in range(B):
                pos[i] += 1
        rows.append((B, L.median(times), min(times), sum(ctxs) / len(ctxs)))
    runner.execute(StepPlan(step, (), freed=tuple(range(S))))
    return rows, tokens


def run(piece: L.Piece, P: dict, ctx) -> None:
    from tinyserve.engine.device import select_device

    dev = select_device(ctx.device)
    import torch
    from bench_kernels import ceilings, timeit  # loadtest/bench_kernels.py

    from tinyserve.engine.model.decoder import DecoderModel
    from tinyserve.engine.model.kv_cache import KVCacheSpec
    from tinyserve.engine.model.rope import rope_tables
    from tinyserve.engine.running.runner import ModelRunner

    dims = P["model"]
    dtype = getattr(torch, P["dtype"])
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[P["dtype"]]
    gbps, tflops = ceilings(dev, dtype)
    piece.info(copy_gbps=round(gbps, 1), matmul_tflops=round(tflops, 1), model=dims)
    t = piece.table("ceilings (measured first, torch)", [
        "device-to-device copy GB/s (read + write)", f"{short} matmul TFLOP/s (random data)"])
    piece.row(t, [round(gbps, 1), round(tflops, 1)])
    cfg = model_config(dims, P["dtype"], P["max_model_len"])
    Hq, Hk, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    base = float_weights(cfg, dtype, dev)
    ks = Kernels(piece, dev, dtype, gbps, timeit)
    steps_t = piece.table("decode steps", [
        "weights", "path", "batch", "context (mean)", "ms/step (median)", "ms/step (min)",
        "floor ms (weights + KV bytes / copy GB/s)", "floor / median"])
    piece.note(KV_NOTE + "; the embedding's V x D is not counted (only B rows are read). "
               "ms/step is ModelRunner.execute's wall time: staging, launches (or one graph "
               "replay), sampling and the copy of the tokens to the host.")
    rng = torch.Generator(device="cpu").manual_seed(7)
    S = max(P["batches"])
    prompts = torch.randint(0, cfg.vocab_size, (S, P["prompt"]), generator=rng).tolist()
    tokens_by = {}
    for fmt in P["formats"]:
        if ctx.deadline.over(20):
            piece.check(f"{fmt} weights: decode and kernels", skipped="out of the piece's budget")
            continue
        label = short if fmt == "float" else fmt
        w = base if fmt == "float" else quantized(base, fmt, dtype)
        # kernels at this format's weights (and, once, LM head, attention and sampling)
        layer = w.layers[0]
        for name, lin in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up),
                          ("down", layer.down)) + ((("LM head", w.lm_head),) if fmt == "float"
                                                   else ()):
            for M in P["kernel_m"]:
                ks.matmul(f"matmul {name}", lin, fmt, M)
        if fmt == "float":
            for B, c in P["attention"]:
                ks.attention(B, c, Hq, Hk, Dh, int8=False)
            for B, c in P["attention"]:
                ks.attention(B, c, Hq, Hk, Dh, int8=True)
            for B in P["sample_b"]:
                ks.sampling(B, cfg.vocab_size)
        weight_bytes = w.nbytes() - nbytes(w.embed)
        for eager in (True, False):
            if ctx.deadline.over(10):
                piece.check(f"{label} {'eager' if eager else 'graphs'} decode",
                            skipped="out of the piece's budget")
                continue
            nb = -(-(P["prompt"] + len(P["batches"]) * (P["warm"] + P["steps"]) + 1) // 16)
            spec = KVCacheSpec(S * nb + 1, 16, cfg.num_layers, Hk, Dh, dtype)
            model = DecoderModel(cfg, w, rope_tables(cfg, P["max_model_len"], dev))
            runner = ModelRunner(model, cfg, spec, dev, max_num_seqs=S,
                                 max_model_len=P["max_model_len"], enforce_eager=eager)
            path = "eager" if eager else ("graphs" if runner.buckets.use_graphs else "buckets (CPU replay)")
            rows, toks = drive(runner, prompts, P["batches"], P["warm"], P["steps"], 16)
            tokens_by[(fmt, eager)] = toks
            for B, med, mn, ctx_sum in rows:
                floor = (weight_bytes + ctx_sum * spec.bytes_per_token) / (gbps * 1e9)
                piece.row(steps_t, [label, path, B,
                                    round(ctx_sum / B), round(med * 1e3, 3), round(mn * 1e3, 3),
                                    round(floor * 1e3, 3), round(floor / med, 3)])
            piece.info(**{f"path_{fmt}_{'eager' if eager else 'buckets'}": path})
            del runner, model
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
        if (fmt, True) in tokens_by and (fmt, False) in tokens_by:
            a, b = tokens_by[(fmt, True)], tokens_by[(fmt, False)]
            same = sum(a[i] == b[i] for i in a)
            piece.check(f"{label}: decode-bucket (graph) tokens == eager tokens, every sequence",
                        same == len(a), value=f"{same}/{len(a)}")
        if fmt != "float":
            del w
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
    for group, entries in ks.worst.items():
        bad = [f"{n} {s}: {e:.3g}" for ok, n, _, s, e in entries if not ok]
        worst = max(e for *_, e in entries)
        piece.check(f"kernels vs torch: {group}", not bad,
                    value=bad[:4] if bad else f"worst {worst:.3g}",
                    limit="tokens right, logprobs within 1e-3" if group == "sampling" else
                    f"rel L2 <= {ks.limit}")
    if dev != "cuda":
        piece.check("CUDA graphs timed", skipped="no CUDA on the CPU: the decode buckets' "
                    "recorded launches are replayed (the graphs path's CPU equivalent)")
        piece.check("bandwidth against the copy ceiling", skipped="CPU interpreter: GB/s are "
                    "computed by the same code but measure the interpreter, not a GPU")
