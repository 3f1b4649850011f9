"""Row-wise kernels against float32 torch references: gather, add+RMSNorm, rotary, SiLU*mul,
KV-cache write. Shapes are deliberately awkward (not multiples of any block size)."""

import math

import pytest
import torch

from tests.kernels.dtypes import bf16
from tinyserve.kernels import add_rmsnorm, apply_rotary, gather_rows, silu_and_mul, write_kv_cache

# (dtype, atol, rtol): fp32 must agree to rounding; fp16 and bf16 to two steps of their
# resolution (~1e-3, ~8e-3: a GPU's approximate rsqrt / exp may round the other way once). The
# kernels compute in fp32 between a load and a store, so bf16 runs in the interpreter too.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3), bf16(1.6e-2, 1.6e-2)]
# exact copies and bit-for-bit comparisons of two kernels
COPY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,V,D", [(1, 7, 3), (37, 513, 72), (130, 100, 200)])
def test_gather_rows(device, dtype, atol, rtol, T, V, D):
    g = torch.Generator().manual_seed(T * V + D)
    table = torch.randn(V, D, generator=g).to(device, dtype)
    ids = torch.randint(0, V, (T,), generator=g).to(device)
    out = gather_rows(ids, table)
    torch.testing.assert_close(out, table[ids], atol=0, rtol=0)


def test_gather_rows_masks_out_of_range_ids(device):
    table = torch.randn(5, 4, device=device)
    out = gather_rows(torch.tensor([0, 5, -1, 4], device=device), table)
    torch.testing.assert_close(out[0], table[0])
    torch.testing.assert_close(out[3], table[4])
    assert torch.count_nonzero(out[1:3]) == 0


def _ref_rmsnorm(x, w, eps):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.float() * normed.float()).to(x.dtype)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 64), (67, 100), (3, 4096), (200, 33)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(device, dtype, atol, rtol, T, D, with_residual):
    g = torch.Generator().manual_seed(T + D)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    res = torch.randn(T, D, generator=g).to(device, dtype) if with_residual else None
    res_before = None if res is None else res.clone()
    out = add_rmsnorm(x, w, 1e-5, residual=res)
    h = x if res is None else (x.float() + res_before.float()).to(dtype)
    torch.testing.assert_close(out, _ref_rmsnorm(h, w, 1e-5), atol=atol, rtol=rtol)
    if res is not None:
        torch.testing.assert_close(res, h, atol=atol, rtol=rtol)


def test_add_rmsnorm_strided_input(device):
    x = torch.randn(9, 50, device=device)[:, :40]  # row stride 50, D 40
    w = torch.randn(40, device=device)
    torch.testing.assert_close(add_rmsnorm(x, w, 1e-6), _ref_rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 64), (67, 100), (5, 3072)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_with_unit_offset_as_gemma(device, dtype, atol, rtol, T, D, with_residual):
    """Gemma2RMSNorm: (x / rms(x)) * (1 + w) in fp32, rounded once (not Llama's round-then-
    multiply)."""
    g = torch.Generator().manual_seed(T * 3 + D)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    w = (0.3 * torch.randn(D, generator=g)).to(device, dtype)
    res = torch.randn(T, D, generator=g).to(device, dtype) if with_residual else None
    h = x if res is None else (x.float() + res.float()).to(dtype)
    hf = h.float()
    ref = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    torch.testing.assert_close(add_rmsnorm(x, w, 1e-6, residual=res, unit_offset=True), ref,
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,V,D", [(1, 7, 3), (37, 513, 72)])
def test_gather_rows_scaled_as_gemma_embeds(device, dtype, atol, rtol, T, V, D):
    """Rows times sqrt(hidden), the scale rounded to the table's dtype first (transformers)."""
    g = torch.Generator().manual_seed(T + V)
    table = torch.randn(V, D, generator=g).to(device, dtype)
    ids = torch.randint(0, V, (T,), generator=g).to(device)
    scale = float(torch.tensor(D ** 0.5, dtype=dtype))
    ref = table[ids] * torch.tensor(scale, dtype=dtype, device=device)
    torch.testing.assert_close(gather_rows(ids, table, scale=scale), ref, atol=0, rtol=0)


def _ref_rotary(x, pos, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[pos][:, None, :].float(), sin[pos][:, None, :].float()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,Dh", [(1, 8, 4, 8), (23, 6, 2, 64), (70, 5, 5, 16), (9, 32, 8, 128)])
def test_rotary_in_place_on_fused_qkv_views(device, dtype, atol, rtol, T, Hq, Hk, Dh):
    g = torch.Generator().manual_seed(T * Hq + Dh)
    max_pos = 300
    inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2).float() / Dh))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g).to(device, dtype)
    q = qkv[:, : Hq * Dh].view(T, Hq, Dh)
    k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
    v_before = qkv[:, (Hq + Hk) * Dh :].clone()
    pos = torch.randint(0, max_pos, (T,), generator=g).to(device)
    q_ref, k_ref = _ref_rotary(q, pos, cos, sin), _ref_rotary(k, pos, cos, sin)
    apply_rotary(q, k, pos, cos, sin)
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, k_ref, atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, (Hq + Hk) * Dh :], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 172), (45, 13), (129, 300)])
def test_silu_and_mul(device, dtype, atol, rtol, T, I):
    g = torch.Generator().manual_seed(T + I)
    x = torch.randn(T, 2 * I, generator=g).to(device, dtype)
    ref = (torch.nn.functional.silu(x[:, :I].float()) * x[:, I:].float()).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 172), (45, 13), (129, 300)])
def test_gelu_tanh_and_mul_as_geglu(device, dtype, atol, rtol, T, I):
    g = torch.Generator().manual_seed(T * I)
    x = (3 * torch.randn(T, 2 * I, generator=g)).to(device, dtype)  # both tails of tanh
    gelu = torch.nn.functional.gelu(x[:, :I].float(), approximate="tanh")
    ref = (gelu * x[:, I:].float()).to(dtype)
    torch.testing.assert_close(silu_and_mul(x, activation="gelu_tanh"), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("T,Hk,Dh,block_size", [(1, 4, 8, 16), (37, 2, 64, 16), (100, 3, 24, 8)])
def test_write_kv_cache_through_slot_mapping(device, dtype, T, Hk, Dh, block_size):
    g = torch.Generator().manual_seed(T + Hk)
    num_blocks = 2 * (T // block_size + 2)
    Hq = 2 * Hk
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g).to(device, dtype)
    k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
    v = qkv[:, (Hq + Hk) * Dh :].view(T, Hk, Dh)
    k_cache = torch.zeros(num_blocks, block_size, Hk, Dh, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(device)
    slots[::5] = -1  # padding tokens are skipped
    write_kv_cache(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    flat_k = k_cache.view(-1, Hk, Dh)
    flat_v = v_cache.view(-1, Hk, Dh)
    assert torch.equal(flat_k[slots[keep]], k[keep])
    assert torch.equal(flat_v[slots[keep]], v[keep])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[keep]] = True
    assert torch.count_nonzero(flat_k[~written]) == 0 and torch.count_nonzero(flat_v[~written]) == 0


def test_rotary_on_separate_q_and_k_tensors(device):
    T, Hq, Hk, Dh = 11, 4, 2, 16
    inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2).float() / Dh))
    ang = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    q = torch.randn(T, Hq, Dh, device=device)
    k = torch.randn(T, Hk, Dh, device=device)
    pos = torch.arange(T, device=device) * 3
    q_ref, k_ref = _ref_rotary(q, pos, cos, sin), _ref_rotary(k, pos, cos, sin)
    apply_rotary(q, k, pos, cos, sin)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)


@pytest.mark.parametrize("T", [1, 3])
def test_rotary_on_fused_qkv_is_one_launch_even_for_one_token(device, monkeypatch, T):
    """q and k views of one fused qkv row are rotated by one launch; with one token torch
    reports the views' (unused) token strides differently, which must not split it in two."""
    from tinyserve.kernels import rotary

    launches = []
    real = rotary._launch
    # (_launch's fifth argument: the heads one launch rotates)
    monkeypatch.setattr(rotary, "_launch", lambda *a: (launches.append(a[4]), real(*a)))
    Hq, Hk, Dh = 4, 2, 8
    ang = torch.arange(16).float()[:, None] * torch.ones(Dh // 2)[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh).to(device)
    q = qkv[:, : Hq * Dh].view(T, Hq, Dh)
    k = qkv[:, Hq * Dh : (Hq + Hk) * Dh].view(T, Hk, Dh)
    pos = torch.arange(T, device=device)
    q_ref, k_ref = _ref_rotary(q, pos, cos, sin), _ref_rotary(k, pos, cos, sin)
    apply_rotary(q, k, pos, cos, sin)
    assert launches == [Hq + Hk]
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    launches.clear()
    apply_rotary(q.clone(), k.clone(), pos, cos, sin)  # separate tensors: one launch each
    assert launches == [Hq, Hk]


def test_update_block_table_scatters_new_blocks(device):
    from tinyserve.kernels import update_block_table

    table = torch.arange(4 * 6, dtype=torch.int32, device=device).view(4, 6)
    want = table.clone()
    # (row, column, block); the last three are out of range and must be skipped
    upd = [(0, 0, 100), (3, 5, 101), (1, 2, 102), (2, 3, 103), (4, 0, 7), (0, 6, 7), (-1, 0, 7)]
    for r, c, b in upd[:4]:
        want[r, c] = b
    update_block_table(table, torch.tensor(upd, dtype=torch.int64, device=device))
    assert torch.equal(table, want)
    update_block_table(table, torch.zeros((0, 3), dtype=torch.int64, device=device))  # no launch
    assert torch.equal(table, want)
    big = torch.zeros((40, 30), dtype=torch.int32, device=device)  # 1,200 cells: two programs
    cells = torch.randperm(1200, generator=torch.Generator().manual_seed(0))
    upd = torch.stack([cells // 30, cells % 30, cells + 5], dim=1).to(device)
    update_block_table(big, upd)
    assert torch.equal(big, torch.arange(1200, dtype=torch.int32, device=device).view(40, 30) + 5)
    with pytest.raises(ValueError, match="updates"):
        update_block_table(table, torch.zeros((2, 4), dtype=torch.int64, device=device))


def fused_rotary_inputs(T, Hq, Hk, Dh, dtype, device):
    """A random fused qkv [T, (Hq + 2Hk) * Dh], rotary tables for 300 positions, positions,
    slots in a 16 x 8 cache (slot 0 padding), and ``views(qkv) -> q, k, v``."""
    g = torch.Generator().manual_seed(T * Hq + Dh)
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g).to(device, dtype)
    cos = torch.randn(300, Dh // 2, generator=g).to(device)
    sin = torch.randn(300, Dh // 2, generator=g).to(device)
    pos = torch.randint(0, 300, (T,), generator=g).to(device)
    slots = torch.randperm(16 * 8, generator=g)[:T].to(device)
    slots[0] = -1  # padding: no write

    def views(x):
        return (x[:, : Hq * Dh].view(T, Hq, Dh), x[:, Hq * Dh: (Hq + Hk) * Dh].view(T, Hk, Dh),
                x[:, (Hq + Hk) * Dh:].view(T, Hk, Dh))

    return qkv, cos, sin, pos, slots, views


@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,Dh", [(1, 8, 4, 8), (5, 4, 4, 16), (70, 8, 2, 24), (3, 32, 8, 128)])
def test_rotary_and_kv_write_in_one_launch_equals_the_two_kernels(device, dtype, T, Hq, Hk, Dh,
                                                                   monkeypatch):
    """Fused rotary + KV write on a fused qkv row: q rotated in place, rotated k and raw v in
    the cache, bit-identical to apply_rotary then write_kv_cache; slot -1 writes nothing."""
    import tinyserve.kernels.rotary as rotary_mod
    from tinyserve.kernels import rotary_and_write_kv

    qkv, cos, sin, pos, slots, views = fused_rotary_inputs(T, Hq, Hk, Dh, dtype, device)
    pos[-1] = 300 + T  # beyond the table: not rotated, k cached as it is (as the two kernels do)
    ref_qkv = qkv.clone()
    rq, rk, rv = views(ref_qkv)
    ref_kc = torch.full((16, 8, Hk, Dh), 7.0, dtype=dtype, device=device)
    ref_vc = ref_kc.clone()
    apply_rotary(rq, rk, pos, cos, sin)
    write_kv_cache(rk, rv, ref_kc, ref_vc, slots)
    kc, vc = torch.full_like(ref_kc, 7.0), torch.full_like(ref_vc, 7.0)
    launches = []
    real_launch = rotary_mod.launch
    monkeypatch.setattr(rotary_mod, "launch", lambda *a, **k: (launches.append(a[0]), real_launch(*a, **k)))
    q, k, v = views(qkv)
    rotary_and_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    assert len(launches) == 1
    assert torch.equal(q, rq) and torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


def test_rotary_and_kv_write_falls_back_for_separate_tensors(device):
    from tinyserve.kernels import rotary_and_write_kv

    T, H, Dh = 4, 2, 8
    q, k, v = (torch.randn(T, H, Dh, device=device) for _ in range(3))  # not one fused row
    cos, sin = torch.randn(16, Dh // 2, device=device), torch.randn(16, Dh // 2, device=device)
    pos = torch.arange(T, device=device)
    slots = torch.arange(T, device=device)
    rq, rk = q.clone(), k.clone()
    apply_rotary(rq, rk, pos, cos, sin)
    kc, vc = torch.zeros(1, 8, H, Dh, device=device), torch.zeros(1, 8, H, Dh, device=device)
    rotary_and_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    assert torch.equal(q, rq) and torch.equal(kc[0, :T], rk) and torch.equal(vc[0, :T], v)


def _ref_norm_rope(x, w, eps, unit_offset, pos, cos, sin):
    """transformers' order: per-head RMSNorm (Qwen3RMSNorm, or Gemma's 1 + w), then rotate the
    first 2 * cos.shape[1] dims, the rest passing through (partial rotary)."""
    if w is not None:
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x = (n * (1.0 + w.float())).to(x.dtype) if unit_offset else w * n.to(x.dtype)
    r = 2 * cos.shape[1]
    return torch.cat([_ref_rotary(x[..., :r], pos, cos, sin), x[..., r:]], dim=-1)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("Dh,rot", [(8, 8), (48, 16), (96, 32), (256, 256), (40, 24)])
@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"])
@pytest.mark.parametrize("fused", [True, False])
def test_partial_rotary_and_qk_norm(device, dtype, atol, rtol, Dh, rot, norm, fused):
    """Phi-3's partial rotary (rotary_dim < head_dim; 40 = 24 + 16 pass-through) and Qwen3 /
    Gemma 3's q/k norm, in the fused qkv + KV-write kernel and in apply_rotary + write."""
    from tinyserve.kernels import rotary_and_write_kv
    from tinyserve.kernels.rotary import QKNorm

    g = torch.Generator().manual_seed(Dh * 7 + rot)
    T, Hq, Hk, eps = 5, 6, 2, 1e-6
    ang = torch.arange(64).float()[:, None] / (100 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g).to(device, dtype)
    qn = None
    if norm is not None:
        w = (0.5 * torch.randn(2, Dh, generator=g)).to(device, dtype)
        qn = QKNorm(w[0].contiguous(), w[1].contiguous(), eps, unit_offset=norm == "gemma")
    pos = torch.randint(0, 64, (T,), generator=g).to(device)
    q, k, v = (qkv[:, : Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh:(Hq + Hk) * Dh].view(T, Hk, Dh),
               qkv[:, (Hq + Hk) * Dh:].view(T, Hk, Dh))
    wq, wk = (None, None) if qn is None else (qn.q_weight, qn.k_weight)
    q_ref = _ref_norm_rope(q, wq, eps, norm == "gemma", pos, cos, sin)
    k_ref = _ref_norm_rope(k, wk, eps, norm == "gemma", pos, cos, sin)
    v_ref = v.clone()
    if not fused:
        q, k, v = q.clone(), k.clone(), v.clone()
    kc = torch.zeros(4, 4, Hk, Dh, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 0, 9, 15, -1], device=device)
    rotary_and_write_kv(q, k, v, pos, cos, sin, kc, vc, slots, qk_norm=qn)
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    flat_k, flat_v = kc.view(16, Hk, Dh), vc.view(16, Hk, Dh)
    for t, s in enumerate(slots.tolist()[:4]):
        torch.testing.assert_close(flat_k[s], k_ref[t], atol=atol, rtol=rtol)
        torch.testing.assert_close(flat_v[s], v_ref[t], atol=0, rtol=0)


@pytest.mark.parametrize("Dh,rot", [(40, 24), (64, 64)])
def test_partial_rotary_and_qk_norm_into_an_int8_cache(device, Dh, rot):
    """The quantizing path sees the whole head (the pass-through dims too) for its scale."""
    from tinyserve.kernels import rotary_and_write_kv
    from tinyserve.kernels.rotary import QKNorm

    g = torch.Generator().manual_seed(Dh)
    T, Hq, Hk = 3, 4, 2
    ang = torch.arange(32).float()[:, None] / (100 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g).to(device)
    qkv[:, (Hq + Hk) * Dh - 3] = 40.0  # a k's largest value in the pass-through dims
    w = (0.5 * torch.randn(2, Dh, generator=g)).to(device)
    qn = QKNorm(w[0].contiguous(), w[1].contiguous(), 1e-6)
    q, k, v = (qkv[:, : Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh:(Hq + Hk) * Dh].view(T, Hk, Dh),
               qkv[:, (Hq + Hk) * Dh:].view(T, Hk, Dh))
    pos = torch.arange(T, device=device)
    k_ref = _ref_norm_rope(k, qn.k_weight, 1e-6, False, pos, cos, sin)
    v_ref = v.clone()
    kc = torch.zeros(1, 4, Hk, Dh, dtype=torch.int8, device=device)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(1, 4, Hk, dtype=torch.float16, device=device)
    vs = torch.zeros_like(ks)
    rotary_and_write_kv(q, k, v, pos, cos, sin, kc, vc, torch.arange(T, device=device), ks, vs,
                        qk_norm=qn)
    deq_k = kc[0, :T].float() * ks[0, :T, :, None].float()
    deq_v = vc[0, :T].float() * vs[0, :T, :, None].float()
    for deq, ref in ((deq_k, k_ref), (deq_v, v_ref)):
        step = ref.abs().amax(-1, keepdim=True) / 127
        assert ((deq - ref).abs() <= step * 0.51 + 1e-3 * step).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_k_and_v_are_cached_as_zeros(device, dtype):
    """NaN, +-inf and (in fp16) values past its range are written as 0 by both write paths,
    the fused rotary one and write_kv_cache; finite values as they are."""
    from tinyserve.kernels import rotary_and_write_kv

    T, Hq, Hk, Dh = 6, 4, 2, 16
    qkv32 = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=torch.Generator().manual_seed(5))
    qkv32[1, Hq * Dh:] = math.inf
    qkv32[3, (Hq + Hk) * Dh + 2] = math.nan
    qkv32[4, (Hq + Hk) * Dh + 1] = 1e30  # finite in fp32, inf in fp16
    inv = 1.0 / 10000 ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh)
    ang = torch.arange(64, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    pos = slots = torch.arange(T, device=device)
    for fused in (False, True):
        qkv = qkv32.to(device, dtype)
        q, k, v = (qkv[:, :Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh:(Hq + Hk) * Dh].view(T, Hk, Dh),
                   qkv[:, (Hq + Hk) * Dh:].view(T, Hk, Dh))
        kc = torch.full((1, 8, Hk, Dh), 7.0, dtype=dtype, device=device)
        vc = torch.full_like(kc, 7.0)
        if fused:
            rotary_and_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
        else:
            write_kv_cache(k, v, kc, vc, slots)
        assert torch.isfinite(kc).all() and torch.isfinite(vc).all(), fused
        assert torch.count_nonzero(kc[0, 1]) == 0 and torch.count_nonzero(vc[0, 1]) == 0
        assert vc[0, 3, 0, 2] == 0 and torch.equal(vc[0, 0], v[0])  # (finite: as it was)
        assert (vc[0, 4, 0, 1] == 0) == (dtype == torch.float16), fused
