"""Kernel benchmark: each Triton kernel against its torch equivalent and its byte/FLOP floor.

    python loadtest/bench_kernels.py                     # GPU: Llama-3-8B shapes, bf16
    python loadtest/bench_kernels.py --shapes tiny       # CPU: interpreter smoke run

Prints time, achieved GB/s and TFLOP/s, and the share of the device's measured ceilings (copy
bandwidth, dense matmul rate, both measured at start). On the CPU the kernels run in Triton's
interpreter: the numbers only show that every kernel runs, not how fast it would be.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

SHAPES = {
    # Llama-3-8B: D 4096, 32 heads / 8 KV heads of 128, I 14336, V 128256.
    "llama3-8b": dict(D=4096, Hq=32, Hk=8, Dh=128, I=14336, V=128256, prefill=2048, decode=64,
                      ctx=2048, dtype="bfloat16"),
    "tiny": dict(D=64, Hq=8, Hk=4, Dh=8, I=172, V=512, prefill=64, decode=8, ctx=64,
                 dtype="float32"),
}


@dataclass
class Case:
    name: str
    run: Callable[[], object]
    ref: Callable[[], object] | None
    bytes: float
    flops: float = 0.0


def timeit(fn: Callable[[], object], device: str) -> float:
    """Median seconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[1]


def ceilings(device: str, dtype) -> tuple[float, float]:
    """(copy GB/s, matmul TFLOP/s) measured with torch on this device."""
    import torch

    n = (1 << 28) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device)
    m = 8192 if device == "cuda" else 256
    a = torch.randn(m, m, device=device).to(dtype)
    tm = timeit(lambda: a @ a, device)
    return 2 * n / t / 1e9, 2 * m**3 / tm / 1e12


def build_cases(s: dict, device: str) -> list[Case]:
    import torch

    import tinyserve.kernels as K
    from tinyserve.engine.loading.quantize import quantize_int8

    dt = getattr(torch, s["dtype"])
    esz = torch.tensor([], dtype=dt).element_size()
    D, Hq, Hk, Dh, I, V = s["D"], s["Hq"], s["Hk"], s["Dh"], s["I"], s["V"]
    T, B, ctx = s["prefill"], s["decode"], s["ctx"]
    r = lambda *shape, dtype=dt: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    cases = []

    ids = torch.randint(0, V, (T,), device=device)
    emb = r(V, D)
    cases.append(Case("gather_rows (embedding)", lambda: K.gather_rows(ids, emb),
                      lambda: torch.nn.functional.embedding(ids, emb), 2 * T * D * esz))
    x, res, w = r(T, D), r(T, D), r(D)

    def torch_rms():
        h = x.float() + res.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * w
    cases.append(Case("add_rmsnorm", lambda: K.add_rmsnorm(x, w, 1e-5, residual=res),
                      torch_rms, 4 * T * D * esz))

    qkv = r(T, (Hq + 2 * Hk) * Dh)
    q, k = qkv[:, : Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
    v = qkv[:, (Hq + Hk) * Dh :].view(T, Hk, Dh)
    pos = torch.arange(T, device=device)
    cos, sin = torch.randn(T, Dh // 2, device=device), torch.randn(T, Dh // 2, device=device)

    def torch_rope():
        c, sn = cos[pos][:, None, :], sin[pos][:, None, :]
        x1, x2 = q[..., : Dh // 2].float(), q[..., Dh // 2 :].float()
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], -1).to(dt)
    cases.append(Case("apply_rotary (q+k)", lambda: K.apply_rotary(q, k, pos, cos, sin),
                      torch_rope, 2 * T * (Hq + Hk) * Dh * esz))

    bs = 16
    nblk = math.ceil(T / bs) + 1
    kc, vc = r(nblk, bs, Hk, Dh), r(nblk, bs, Hk, Dh)
    slots = torch.arange(T, device=device)
    cases.append(Case("write_kv_cache", lambda: K.write_kv_cache(k, v, kc, vc, slots),
                      lambda: kc.view(-1, Hk, Dh).index_copy_(0, slots, k),
                      4 * T * Hk * Dh * esz))

    for M in (B, T):
        a, wq = r(M, D), r((Hq + 2 * Hk) * Dh, D)
        N = wq.shape[0]
        cases.append(Case(f"matmul qkv M={M}", lambda a=a, wq=wq: K.matmul(a, wq),
                          lambda a=a, wq=wq: a @ wq.T, (M * D + N * D + M * N) * esz, 2 * M * N * D))
    a = r(B, D)
    lin = quantize_int8(torch.randn(2 * I, D))
    w8, sc = lin.weight.to(device), lin.scale.to(device)
    cases.append(Case(f"int8_matmul gate_up M={B}", lambda: K.int8_matmul(a, w8, sc),
                      lambda: a @ (w8.to(dt) * sc[:, None].to(dt)).T,
                      2 * I * D + (B * D + B * 2 * I) * esz, 2 * B * 2 * I * D))
    gu = r(T, 2 * I)
    cases.append(Case("silu_and_mul", lambda: K.silu_and_mul(gu),
                      lambda: torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], 3 * T * I * esz))

    # Attention: prefill of 4 sequences of T/4 tokens; decode of B sequences at ctx tokens.
    P, L = 4, T // 4
    nb = math.ceil(max(L, ctx) / bs)
    kc, vc = r(max(P, B) * nb + 1, bs, Hk, Dh), r(max(P, B) * nb + 1, bs, Hk, Dh)
    tables = torch.arange(max(P, B) * nb, device=device, dtype=torch.int32).view(max(P, B), nb)
    qp = r(P * L, Hq, Dh)
    lens = torch.full((P,), L, device=device, dtype=torch.int32)
    starts = torch.arange(0, P * L + 1, L, device=device, dtype=torch.int32)
    qs, ks_, vs = r(P, Hq, L, Dh), r(P, Hq, L, Dh), r(P, Hq, L, Dh)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases.append(Case(f"context_attention {P}x{L}", lambda: K.context_attention_paged(
        qp, kc, vc, tables[:P], lens, starts, L), lambda: sdpa(qs, ks_, vs, is_causal=True),
        (2 * P * L * Hq * Dh + 2 * P * L * Hk * Dh) * esz, 2 * P * L * L * Hq * Dh))
    qd = r(B, Hq, Dh)
    dlens = torch.full((B,), ctx, device=device, dtype=torch.int32)
    qd4, kd4 = r(B, Hq, 1, Dh), r(B, Hq, ctx, Dh)
    cases.append(Case(f"token_attention {B}x{ctx}", lambda: K.token_attention_paged(
        qd, kc, vc, tables[:B], dlens, ctx), lambda: sdpa(qd4, kd4, kd4),
        2 * B * ctx * Hk * Dh * esz, 4 * B * Hq * ctx * Dh))

    logits = torch.randn(B, V, device=device)
    t = torch.full((B,), 0.8, device=device)
    tk = torch.full((B,), 50, device=device, dtype=torch.int32)
    tp = torch.full((B,), 0.9, device=device)
    seeds = torch.arange(B, device=device, dtype=torch.int64)
    cases.append(Case("sample (top-k + top-p)", lambda: K.sample(logits, t, tk, tp, seeds),
                      lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1),
                      B * V * 4))
    cases.append(Case("sample (greedy)", lambda: K.sample(logits, t, tk, tp, seeds,
                                                          all_greedy=True),
                      lambda: logits.argmax(-1), B * V * 4))
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                    help="llama3-8b on a GPU, tiny on the CPU (default by device)")
    args = ap.parse_args(argv)
    from tinyserve.engine.device import select_device

    device = select_device()
    shapes = SHAPES[args.shapes or ("llama3-8b" if device == "cuda" else "tiny")]
    import torch

    dt = getattr(torch, shapes["dtype"])
    if device == "cpu" and dt == torch.bfloat16:
        raise SystemExit("bf16 shapes need a GPU (the interpreter computes bf16 wrongly)")
    gbps, tflops = ceilings(device, dt)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}; ceilings: copy {gbps:.0f} GB/s, {shapes['dtype']} matmul "
          f"{tflops:.1f} TFLOP/s")
    print("| kernel | triton ms | torch ms | GB/s | % copy | TFLOP/s | % matmul |")
    print("|---|---|---|---|---|---|---|")
    for c in build_cases(shapes, device):
        t = timeit(c.run, device)
        tr = timeit(c.ref, device) if c.ref else float("nan")
        bw = c.bytes / t / 1e9
        fl = c.flops / t / 1e12
        print(f"| {c.name} | {t * 1e3:.3f} | {tr * 1e3:.3f} | {bw:.1f} | {100 * bw / gbps:.0f}% | "
              f"{fl:.2f} | {100 * fl / tflops:.0f}% |")


if __name__ == "__main__":
    main()
