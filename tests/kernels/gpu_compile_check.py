"""Compile every kernel for an NVIDIA Hopper GPU (sm_90) with the configurations the
launchers choose on a GPU, without a GPU: the launchers run on CPU tensors with
``JITFunction.run`` replaced by a recorder, and each recorded launch is bound and specialized
exactly as the JIT would (stride-1 and 16-divisible arguments, pointer alignment), then
compiled through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via ptxas).
With ``--resources`` it also prints registers / stack (spills) per kernel via cuobjdump.

Run as a script in a process where TRITON_INTERPRET is unset (the test does that); prints one
line per compiled variant and exits non-zero on the first failure.

It drives Triton-private internals (``REQUIRES``), checked before anything runs: a Triton
whose internals moved exits with ``UNSUPPORTED`` and one line naming its version and what is
missing (the test skips on it). Checked on Triton 3.6.0 and 3.9.0: the same internals, both
compile every variant.
"""

import inspect
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "must run without the interpreter"

import torch  # noqa: E402
import triton  # noqa: E402

UNSUPPORTED = 3  # exit status: this Triton lacks an internal the check drives
REQUIRES = ("triton.backends.compiler.GPUTarget, triton.compiler.ASTSource(fn, signature, "
            "constexprs, attrs) and make_backend, triton.runtime.jit.JITFunction.run(*args, "
            "grid, warmup, **kwargs) and ._pack_args(backend, kwargs, bound_args, "
            "specialization, options), create_function_from_signature(sig, kparams, backend)")


def _missing_internals() -> str | None:
    """What this Triton lacks of ``REQUIRES`` (None: everything is there, in that shape)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        return str(e)
    shapes = [("create_function_from_signature", create_function_from_signature,
               ["sig", "kparams", "backend"]),
              ("JITFunction._pack_args", getattr(JITFunction, "_pack_args", None),
               ["self", "backend", "kwargs", "bound_args", "specialization", "options"]),
              ("ASTSource", ASTSource.__init__, ["self", "fn", "signature", "constexprs", "attrs"])]
    for name, fn, want in shapes:
        if fn is None:
            return name
        have = list(inspect.signature(fn).parameters)
        if have != want:
            return f"{name}({', '.join(want[want[0] == 'self':])}): it takes ({', '.join(have)})"
    run = inspect.signature(JITFunction.run).parameters
    if not {"grid", "warmup"} <= run.keys():
        return f"JITFunction.run(*args, grid, warmup, **kwargs): it takes ({', '.join(run)})"
    return None


if (_missing := _missing_internals()) is not None:
    print(f"UNSUPPORTED: Triton {triton.__version__} lacks {_missing}; this check needs {REQUIRES}")
    sys.exit(UNSUPPORTED)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

captured = []


def record(self, *args, grid, warmup, **kwargs):
    captured.append((self, args, kwargs))


JITFunction.run = record

import tinyserve.kernels as K  # noqa: E402

# CPU tensors stand in for the GPU's: launchers size split-K for an H100/H200's 132 SMs.
sys.modules["tinyserve.kernels.matmul"]._sm_count = lambda index: 132
from tinyserve.engine.loading.quantize import quantize_int8  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)


def compile_like_the_jit(fn: JITFunction, args, kwargs):
    """What JITFunction.run does before launching: bind, specialize, pack, compile."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound,
                                                          specialization, options)
    key = (fn.__name__, str(signature), str(constexprs), str(attrs), str(options))
    src = ASTSource(fn, signature, constexprs, attrs)
    return key, constexprs, lambda: triton.compile(src, target=TARGET, options=options.__dict__)


def split_qkv(qkv, Hq, Hk, Dh):
    """q, k, v as the model takes them: views of one fused projection row."""
    T = qkv.shape[0]
    return (qkv[:, : Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh: (Hq + Hk) * Dh].view(T, Hk, Dh),
            qkv[:, (Hq + Hk) * Dh:].view(T, Hk, Dh))


def exercise(dtype):
    """Call every launcher with Llama-like GPU shapes (small sizes keep it quick)."""
    T, D, Hq, Hk, Dh, I, V, B = 40, 256, 8, 2, 128, 512, 1000, 4
    r = lambda *s, dt=dtype: torch.randn(*s).to(dt)  # noqa: E731
    K.gather_rows(torch.zeros(T, dtype=torch.int64), r(V, D))
    K.add_rmsnorm(r(T, D), r(D), 1e-5, residual=r(T, D))
    q, k, v = split_qkv(r(T, (Hq + 2 * Hk) * Dh), Hq, Hk, Dh)
    K.apply_rotary(q, k, torch.arange(T), torch.randn(T, Dh // 2), torch.randn(T, Dh // 2))
    kc, vc = r(8, 16, Hk, Dh), r(8, 16, Hk, Dh)
    K.write_kv_cache(k, v, kc, vc, torch.arange(T))
    K.rotary_and_write_kv(q, k, v, torch.arange(T), torch.randn(T, Dh // 2),
                          torch.randn(T, Dh // 2), kc, vc, torch.arange(T))
    K.matmul(r(T, D), r(I, D))
    lin = quantize_int8(torch.randn(I, D))
    K.int8_matmul(r(T, D), lin.weight, lin.scale)
    q4, s4, z4 = K.quantize_int4(torch.randn(I, D), group_size=64, symmetric=False)
    K.int4_matmul(r(T, D), q4, s4.to(dtype), z4, 64)
    K.int4_matmul(r(T, D), q4, s4.to(dtype), None, 64)
    K.silu_and_mul(r(T, 2 * I))
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    K.context_attention_paged(r(T, Hq, Dh), kc, vc, tables, torch.tensor([20, 30], dtype=torch.int32),
                              torch.tensor([0, 20, 40], dtype=torch.int32), 20)
    for split in (None, 16):  # single split, and split-KV + merge
        K.token_attention_paged(r(2, Hq, Dh), kc, vc, tables,
                                torch.tensor([20, 60], dtype=torch.int32), 60,
                                split_size=split, block_n=16 if split else None)
    # The runner's persistent table: rows named per sequence, int64 statics (decode buckets).
    rows, lens64 = torch.tensor([1, 0]), torch.tensor([20, 60])
    K.token_attention_paged(r(2, Hq, Dh), kc, vc, tables, lens64, 60, split_size=16,
                            block_n=16, table_rows=rows)
    K.context_attention_paged(r(T, Hq, Dh), kc, vc, tables, torch.tensor([20, 30], dtype=torch.int32),
                              torch.tensor([0, 20, 40], dtype=torch.int32), 20,
                              table_rows=rows.int())
    K.update_block_table(tables, torch.tensor([[0, 1, 5], [1, 3, 2]]))
    # --kv-cache-dtype int8: quantizing writes, and attention dequantizing (scales folded)
    kq, vq = torch.zeros(8, 16, Hk, Dh, dtype=torch.int8), torch.zeros(8, 16, Hk, Dh, dtype=torch.int8)
    ks, vs = torch.ones(8, 16, Hk, dtype=torch.float16), torch.ones(8, 16, Hk, dtype=torch.float16)
    K.write_kv_cache(k, v, kq, vq, torch.arange(T), ks, vs)
    K.rotary_and_write_kv(q, k, v, torch.arange(T), torch.randn(T, Dh // 2),
                          torch.randn(T, Dh // 2), kq, vq, torch.arange(T), ks, vs)
    K.context_attention_paged(r(T, Hq, Dh), kq, vq, tables, torch.tensor([20, 30], dtype=torch.int32),
                              torch.tensor([0, 20, 40], dtype=torch.int32), 20, table_rows=rows.int(),
                              k_scale=ks, v_scale=vs)
    K.token_attention_paged(r(2, Hq, Dh), kq, vq, tables, lens64, 60, split_size=16, block_n=16,
                            table_rows=rows, k_scale=ks, v_scale=vs)
    if dtype == torch.float32:
        logits = torch.randn(B, V)
        p = (torch.full((B,), 0.8), torch.full((B,), 5, dtype=torch.int32), torch.full((B,), 0.9),
             torch.arange(B, dtype=torch.int64))
        K.sample(logits, *p, num_top_logprobs=3)
        K.sample(logits, *p, all_greedy=True)
        words = torch.full((B, -(-V // 32)), -1, dtype=torch.int32)
        K.sample(logits, *p, num_top_logprobs=3, processed=logits.clone(), allowed=words)
        toks = torch.zeros((B, 37), dtype=torch.int32)
        ones = torch.ones(B)
        K.apply_penalties(logits, toks, toks, toks, torch.zeros((B, 37)), ones, ones, ones)
        K.target_logprobs(logits, torch.zeros(B, dtype=torch.int64), 3)
    exercise_lora(dtype)


def exercise_lora(dtype):
    """Multi-LoRA shrink / expand at Llama-3-8B sizes (hidden 4096; q and o 4096, k and v 1024,
    FFN 14336), ranks 16 and 64, 8 resident slots: one shrink per projection with its modules'
    A stacked along R (q | k | v, gate | up), each slice expanded at its offsets; a 16-row
    decode (split-K in separate programs) and a prefill (the K chunks inside each program).
    fp32 (debugging): the decode at rank 16."""
    from tinyserve.kernels.lora import lora_expand, lora_shrink

    D, Nq, Nkv, I, S, B, T = 4096, 4096, 1024, 14336, 8, 16, 2048
    e = lambda *s, dt=dtype: torch.empty(*s, dtype=dt)  # noqa: E731
    scales = torch.ones(S)
    # (input size, output slices): qkv, o_proj, gate_up, down_proj
    projections = ((D, (Nq, Nkv, Nkv)), (D, (D,)), (D, (I, I)), (I, (D,)))
    cases = [(16, B, None)] if dtype == torch.float32 else \
        [(rank, rows, grid) for rank in (16, 64) for rows, grid in ((B, None), (T, False))]
    for rank, rows, grid in cases:
        slots = torch.zeros(rows, dtype=torch.int32)
        for k, slices in projections:
            y = lora_shrink(e(rows, k), e(S, len(slices) * rank, k), slots, split_grid=grid)
            out = e(rows, sum(slices))
            for i, n in enumerate(slices):
                lora_expand(y, e(S, n, rank), slots, scales, out, i * rank, sum(slices[:i]))


def resources(cubin: bytes) -> str:
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "REG:" in x), "")
    return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "SHARED"))


def exercise_llama3_8b():
    """The launchers at Llama-3-8B sizes, bf16 (hidden 4096, GQA 32/8 x 128, FFN 14336, vocab
    128256, a 16-sequence decode at 8k context): the configurations that differ from the small
    shapes' (wider rows, more heads, the full vocabulary). Weights are uninitialised."""
    D, Hq, Hk, Dh, I, V, B, T = 4096, 32, 8, 128, 14336, 128256, 16, 40
    bf = torch.bfloat16
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt)  # noqa: E731
    K.gather_rows(torch.zeros(T, dtype=torch.int64), e(V, D))
    K.add_rmsnorm(e(T, D), e(D), 1e-5, residual=e(T, D))
    q, k, v = split_qkv(e(T, (Hq + 2 * Hk) * Dh), Hq, Hk, Dh)
    K.apply_rotary(q, k, torch.arange(T), torch.randn(8192, Dh // 2), torch.randn(8192, Dh // 2))
    kc, vc = e(64, 16, Hk, Dh), e(64, 16, Hk, Dh)
    K.write_kv_cache(k, v, kc, vc, torch.arange(T))
    cos, sin = torch.randn(8192, Dh // 2), torch.randn(8192, Dh // 2)
    K.rotary_and_write_kv(q, k, v, torch.arange(T), cos, sin, kc, vc, torch.arange(T))
    K.matmul(e(B, D), e(Hq * Dh + 2 * Hk * Dh, D))
    K.silu_and_mul(e(B, 2 * I))
    lin = quantize_int8(torch.randn(256, D))
    K.int8_matmul(e(B, D), lin.weight, lin.scale)
    K.matmul(e(B, D), e(D, D), split_k=4)  # o_proj's split-K on 132 SMs, and its sum kernel
    K.int8_matmul(e(B, D), lin.weight, lin.scale, split_k=4)
    K.matmul(e(2048, D), e(D, D))  # a prefill: 1,024 tiles, the 4 K chunks inside each program
    K.int8_matmul(e(2048, D), lin.weight, lin.scale, split_k=4, split_grid=False)
    q4, s4, z4 = e(D, D // 8, dt=torch.int32), e(D, D // 128), e(D, D // 128, dt=torch.uint8)
    K.int4_matmul(e(B, D), q4, s4)  # o_proj-sized decode: split-K 4 in separate programs
    K.int4_matmul(e(B, D), q4, s4, z4)
    K.int4_matmul(e(2048, D), q4, s4, z4)  # prefill: the 4 K chunks inside each program
    K.int4_matmul(e(B, D), e(I, D // 8, dt=torch.int32), e(I, D // 128))  # 112 tiles: no split
    tables = torch.zeros((2 * B + 1, 512), dtype=torch.int32)
    K.token_attention_paged(e(B, Hq, Dh), kc, vc, tables, torch.full((B,), 8192), 8192,
                            table_rows=torch.arange(B))
    kq, vq = e(64, 16, Hk, Dh, dt=torch.int8), e(64, 16, Hk, Dh, dt=torch.int8)
    ks, vs = e(64, 16, Hk, dt=torch.float16), e(64, 16, Hk, dt=torch.float16)
    K.rotary_and_write_kv(q, k, v, torch.arange(T), cos, sin, kq, vq, torch.arange(T), ks, vs)
    K.token_attention_paged(e(B, Hq, Dh), kq, vq, tables, torch.full((B,), 8192), 8192,
                            table_rows=torch.arange(B), k_scale=ks, v_scale=vs)
    K.context_attention_paged(e(T, Hq, Dh), kq, vq, tables, torch.tensor([20, 8192]),
                              torch.tensor([0, 20, 40]), 20, table_rows=torch.arange(2),
                              k_scale=ks, v_scale=vs)
    logits = torch.empty(B, V)
    p = (torch.full((B,), 0.8), torch.full((B,), 5, dtype=torch.int32), torch.full((B,), 0.9),
         torch.arange(B, dtype=torch.int64))
    K.sample(logits, *p, num_top_logprobs=3)
    K.sample(logits, *p, all_greedy=True)


# (name, hidden, q heads, kv heads, head_dim, rotary_dim, FFN, vocab, window, family switches)
FAMILY_SHAPES = [
    ("qwen2.5-7b", 3584, 28, 4, 128, 128, 18944, 152064, None, dict(qkv_bias=True)),
    ("qwen3-8b", 4096, 32, 8, 128, 128, 12288, 151936, None, dict(qk_norm=True)),
    ("mistral-7b-v0.1", 4096, 32, 8, 128, 128, 14336, 32000, 4096, {}),
    ("gemma-2-9b", 3584, 16, 8, 256, 256, 14336, 256000, 4096, dict(
        gemma=True, attn_softcap=50.0, final_softcap=30.0)),
    ("gemma-3-12b", 3840, 16, 8, 256, 256, 15360, 262208, 1024, dict(gemma=True, qk_norm=True)),
    ("phi-3-mini", 3072, 32, 32, 96, 96, 8192, 32064, 2047, {}),
    ("phi-4-mini", 3072, 24, 8, 128, 96, 8192, 200064, None, {}),
]


# (name, hidden, expert FFN, experts, top k, activation, softmax first, biases, shared FFN)
MOE_SHAPES = [
    ("qwen3-30b-a3b", 2048, 768, 128, 8, "silu", True, False, 0),
    ("mixtral-8x7b", 4096, 14336, 8, 2, "silu", True, False, 0),
    ("qwen2-moe-a2.7b", 2048, 1408, 60, 4, "silu", True, False, 5632),
    ("gpt-oss-20b", 2880, 2880, 32, 4, "swiglu_oai", False, True, 0),
    ("gpt-oss-120b", 2880, 2880, 128, 4, "swiglu_oai", False, True, 0),
]


def exercise_moe():
    """The fused-MoE launchers at real MoE shapes in bf16, a decode step (16 tokens) and a
    prefill (2048): routing (with the expert counters), the sort, both grouped GEMMs (float,
    int8 and int4 experts, gpt-oss's biases and clamped SwiGLU), the combine (with Qwen2-MoE's
    shared expert); and gpt-oss's attention (64 / 8 heads of 64, sinks, a window of 128 on
    alternate layers) over float and int8 caches. Weights are uninitialised."""
    bf = torch.bfloat16
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt)  # noqa: E731
    for _, D, F, E, k, act, softmax_first, bias, shared in MOE_SHAPES:
        w13, w2 = e(E, 2 * F, D), e(E, D, F)
        biases = dict(w13_bias=e(E, 2 * F), w2_bias=e(E, D)) if bias else {}
        for T in (16, 2048):
            extra = dict(shared=e(T, D), shared_gate=e(T, 1)) if shared else {}
            K.fused_moe(e(T, D), e(T, E), w13, w2, k, softmax_first=softmax_first,
                        renormalize=softmax_first, activation=act, counts=torch.zeros(
                            E, dtype=torch.int64), rows=torch.arange(T), **biases, **extra)
        if D == 2048 and not shared:  # int8 and int4 experts (--quantization)
            q13, q2 = e(E, 2 * F, D, dt=torch.int8), e(E, D, F, dt=torch.int8)
            int4 = [K.Int4Experts(e(E, n, k_ // 8, dt=torch.int32), e(E, n, k_ // 128),
                                  e(E, n, k_ // 128, dt=torch.uint8), 128, k_)
                    for n, k_ in ((2 * F, D), (D, F))]
            for T in (16, 2048):
                K.fused_moe(e(T, D), e(T, E), q13, q2, k, softmax_first=True, renormalize=True,
                            w13_scale=e(E, 2 * F, dt=torch.float32),
                            w2_scale=e(E, D, dt=torch.float32))
                K.fused_moe(e(T, D), e(T, E), *int4, k, softmax_first=True, renormalize=True)
    B, T, ctx, Hq, Hk, Dh = 16, 40, 8192, 64, 8, 64
    sinks = e(Hq, dt=torch.float32)
    kc, vc = e(64, 16, Hk, Dh), e(64, 16, Hk, Dh)
    kq, vq = e(64, 16, Hk, Dh, dt=torch.int8), e(64, 16, Hk, Dh, dt=torch.int8)
    ks, vs = e(64, 16, Hk, dt=torch.float16), e(64, 16, Hk, dt=torch.float16)
    tables = torch.zeros((2 * B + 1, 512), dtype=torch.int32)
    for window in (128, None):
        for cache, scales in (((kc, vc), {}), ((kq, vq), dict(k_scale=ks, v_scale=vs))):
            K.token_attention_paged(e(B, Hq, Dh), *cache, tables, torch.full((B,), ctx), ctx,
                                    table_rows=torch.arange(B), window=window, sinks=sinks,
                                    **scales)
            K.context_attention_paged(e(T, Hq, Dh), *cache, tables, torch.tensor([20, ctx]),
                                      torch.tensor([0, 20, 40]), 20, table_rows=torch.arange(2),
                                      window=window, sinks=sinks, **scales)


def exercise_families():
    """The launchers at each family's real shapes in bf16, with its switches: projection
    biases in the epilogue, q/k RMSNorm fused with rotary (float and int8 KV), (1 + w) norms,
    GELU-tanh GeGLU, the scaled embedding gather, windowed and soft-capped paged attention
    (prefill and split decode), partial rotary, the soft-capped LM head, the full vocabulary
    in sampling. Weights are uninitialised."""
    from tinyserve.kernels.rotary import QKNorm

    bf, B, T, ctx = torch.bfloat16, 16, 40, 8192
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt)  # noqa: E731
    for _, D, Hq, Hk, Dh, rot, I, V, window, sw in FAMILY_SHAPES:
        gemma = sw.get("gemma", False)
        qkv_n = (Hq + 2 * Hk) * Dh
        K.gather_rows(torch.zeros(T, dtype=torch.int64), e(V, D),
                      scale=D ** 0.5 if gemma else None)
        K.add_rmsnorm(e(T, D), e(D), 1e-6, residual=e(T, D), unit_offset=gemma)
        bias = e(qkv_n) if sw.get("qkv_bias") else None
        for rows in (B, 2048):  # decode and prefill tiles
            K.matmul(e(rows, D), e(qkv_n, D), bias=bias)
        q, k, v = split_qkv(e(T, qkv_n), Hq, Hk, Dh)
        cos, sin = torch.randn(ctx, rot // 2), torch.randn(ctx, rot // 2)
        norm = QKNorm(e(Dh), e(Dh), 1e-6, gemma) if sw.get("qk_norm") else None
        kc, vc = e(64, 16, Hk, Dh), e(64, 16, Hk, Dh)
        K.rotary_and_write_kv(q, k, v, torch.arange(T), cos, sin, kc, vc, torch.arange(T),
                              qk_norm=norm)
        kq, vq = e(64, 16, Hk, Dh, dt=torch.int8), e(64, 16, Hk, Dh, dt=torch.int8)
        ks, vs = e(64, 16, Hk, dt=torch.float16), e(64, 16, Hk, dt=torch.float16)
        K.rotary_and_write_kv(q, k, v, torch.arange(T), cos, sin, kq, vq, torch.arange(T),
                              ks, vs, qk_norm=norm)
        K.silu_and_mul(e(B, 2 * I), activation="gelu_tanh" if gemma else "silu")
        tables = torch.zeros((2 * B + 1, 512), dtype=torch.int32)
        shape = dict(window=window, softcap=sw.get("attn_softcap"),
                     sm_scale=Dh ** -0.5)
        for cache, scales in (((kc, vc), {}), ((kq, vq), dict(k_scale=ks, v_scale=vs))):
            K.token_attention_paged(e(B, Hq, Dh), *cache, tables, torch.full((B,), ctx), ctx,
                                    table_rows=torch.arange(B), **scales, **shape)
            K.context_attention_paged(e(T, Hq, Dh), *cache, tables, torch.tensor([20, ctx]),
                                      torch.tensor([0, 20, 40]), 20,
                                      table_rows=torch.arange(2), **scales, **shape)
        K.matmul(e(B, D), e(V, D), softcap=sw.get("final_softcap"))  # the LM head
        logits = torch.empty(B, V)
        p = (torch.full((B,), 0.8), torch.full((B,), 5, dtype=torch.int32),
             torch.full((B,), 0.9), torch.arange(B, dtype=torch.int64))
        K.sample(logits, *p, num_top_logprobs=3)
        K.target_logprobs(torch.empty(70, V), torch.zeros(70, dtype=torch.int64), 3)


def _tiny_runner(max_num_seqs: int, max_model_len: int, enforce_eager: bool, kv_int8: bool = False,
                 switches: bool = False):
    """A ModelRunner with GPU launch configurations on CPU tensors (weights never read).
    ``switches``: every family switch on at once (biases, (1 + w) q/k and sandwich norms,
    GELU-tanh, both soft-caps, an embedding scale, partial rotary, a window on one of the two
    layers with its own rope)."""
    from tinyserve.engine.loading.model_config import ModelConfig
    from tinyserve.engine.model.decoder import DecoderModel
    from tinyserve.engine.model.kv_cache import KVCacheSpec
    from tinyserve.engine.model.rope import rope_tables
    from tinyserve.engine.model.weights import LayerWeights, Linear, ModelWeights
    from tinyserve.engine.running.runner import ModelRunner

    on = dict(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True, norm_unit_offset=True,
              sandwich_norms=True, activation="gelu_tanh", attn_scale=0.1, attn_softcap=50.0,
              final_softcap=30.0, embed_scale=16.0, rotary_dim=64, sliding_window=64,
              layer_types=("sliding_attention", "full_attention"), local_rope_theta=10000.0,
              architecture="Gemma3ForCausalLM") if switches else {}
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=None, max_position_embeddings=max_model_len,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
                      torch_dtype="bfloat16", **on)
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731
    D, I, q, kv = 256, 512, 8 * 128, 2 * 128

    def lin(n: int, k: int) -> Linear:
        return Linear(e(n, k), bias=e(n) if switches else None)

    extra = dict(pre_ffn_norm=e(D), post_ffn_norm=e(D), q_norm=e(128), k_norm=e(128)) \
        if switches else {}
    layers = [LayerWeights(e(D), lin(q + 2 * kv, D), lin(D, q), e(D), lin(2 * I, D), lin(D, I),
                           **extra) for _ in range(2)]
    weights = ModelWeights(e(1000, D), layers, e(D), Linear(e(1000, D)))
    spec = KVCacheSpec(512, 16, 2, 2, 128, torch.bfloat16, kv_int8)
    model = DecoderModel(cfg, weights, rope_tables(cfg, max_model_len, "cpu"))
    return ModelRunner(model, cfg, spec, "cpu", max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, enforce_eager=enforce_eager)


def warm_up_coverage() -> int:
    """Every specialization serving meets must have been launched by the warm-up: launch keys
    as Triton's JIT computes them (bound arguments, specialization, constexprs, options) for
    the warm-up, then for steps of every kind and size; a key serving adds is a compile that
    would happen while serving. With decode buckets, with --enforce-eager, and with buckets
    over an int8 KV cache, and with every family switch on; matmuls take the split-K policy
    of a 132-SM GPU."""
    return max(_coverage(*v) for v in ((False, False), (True, False), (False, True),
                                       (False, False, True)))


def _coverage(enforce_eager: bool, kv_int8: bool = False, switches: bool = False) -> int:
    from tinyserve.engine.running.warmup import warm_up
    from tinyserve.messages import SamplingParams, ScheduledSeq, StepPlan

    def keys():
        return {compile_like_the_jit(fn, a, k)[0] for fn, a, k in captured}

    runner = _tiny_runner(max_num_seqs=16, max_model_len=2048, enforce_eager=enforce_eager,
                          kv_int8=kv_int8, switches=switches)
    captured.clear()
    warm_up(runner, compile_all=True)
    warm = keys()
    captured.clear()
    variants = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
                SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=5),
                SamplingParams(temperature=0.8, top_p=0.9),
                SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logprobs=2),
                SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias={3: 2.0}),
                SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.2, logprobs=1)]
    ids = iter(range(10**6))
    step = iter(range(1, 10**6))

    def run(decode_lens, chunks, params):
        seqs = []
        for n in decode_lens:  # decodes at context n
            seqs.append(ScheduledSeq(next(ids), (5,), n - 1, tuple(range(-(-n // 16))), True,
                                     params, 0))
        for ctx, n, last in chunks:  # prefill chunks: n tokens after ctx cached ones
            seqs.append(ScheduledSeq(next(ids), (5,) * n, ctx, tuple(range(-(-(ctx + n) // 16))),
                                     last, params, 0))
        runner.execute(StepPlan(next(step), tuple(seqs)))
        runner.execute(StepPlan(next(step), (), freed=tuple(s.seq_id for s in seqs)))

    for params in variants:
        for n in range(1, 17):
            run([3 + 7 * i for i in range(n)], [], params)  # short contexts
            run([2048 - i for i in range(n)], [], params)  # long ones: several splits
    for d in (0, 1, 2, 3, 15, 16):
        for chunk in (1, 2, 3, 15, 16, 17, 31, 32, 33, 100):
            for ctx, last in ((0, True), (40, False), (1000, True)):
                run([50 + i for i in range(d)], [(ctx, chunk, last)], variants[0])
    run([], [(0, 5, True), (3, 17, False), (0, 33, True)], variants[-1])
    for params in (SamplingParams(temperature=0.0, prompt_logprobs=0, logprobs=1),
                   SamplingParams(temperature=0.8, prompt_logprobs=3)):
        for n in (2, 5, 16, 17, 40):  # prompt logprobs of a chunk of n (n - 1 targets)
            seqs = (ScheduledSeq(next(ids), (5,) * n, 0, tuple(range(-(-n // 16))), True,
                                 params, 0, prompt_targets=(5,) * (n - 1)),)
            runner.execute(StepPlan(next(step), seqs))
            runner.execute(StepPlan(next(step), (), freed=(seqs[0].seq_id,)))
    served = keys()
    missing = served - warm
    for key in sorted(missing):  # the closest warm-up key, and how this one differs
        near = min((k for k in warm if k[0] == key[0]), default=None,
                   key=lambda k: sum(a != b for a, b in zip(k, key, strict=True)))
        diff = [(i, key[i][:300]) for i in range(1, 5) if near is None or key[i] != near[i]]
        print(f"not warmed up: {key[0]} {diff}")
    splits = sum(1 for fn, _, _ in captured if fn.__name__ == "_split_k_sum_kernel")
    print(f"{'enforce-eager' if enforce_eager else 'decode buckets'}"
          f"{' over int8 KV' if kv_int8 else ''}{' with every family switch' if switches else ''}"
          f": warm-up launched "
          f"{len(warm)} specializations; serving used {len(served)} ({splits} split-K sums), "
          f"{len(missing)} of them not warmed up")
    return 1 if missing else 0


def main() -> int:
    if "--warm-up" in sys.argv:
        return warm_up_coverage()
    show_resources = "--resources" in sys.argv
    seen = set()
    shapes = {"llama3-8b": exercise_llama3_8b, "families": exercise_families,
              "moe": exercise_moe}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, *shapes):
        captured.clear()
        shapes[dtype]() if dtype in shapes else exercise(dtype)
        for fn, args, kwargs in captured:
            key, consts, build = compile_like_the_jit(fn, args, kwargs)
            if key in seen:
                continue
            seen.add(key)
            try:
                compiled = build()
            except Exception as e:
                print(f"FAIL {fn.__name__} {dtype}: {e}")
                return 1
            extra = resources(compiled.asm["cubin"]) if show_resources else \
                f"shared memory {compiled.metadata.shared} B"
            names = [p.name for p in fn.params]
            flags = {names[k[0]]: v for k, v in consts.items() if names[k[0]][0].isupper()}
            print(f"ok   {fn.__name__:34s} {str(dtype):15s} {extra}  {flags}")
    print(f"{len(seen)} kernel variants compiled for sm_90 (Triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
