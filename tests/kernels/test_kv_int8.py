"""int8 KV cache: the write kernels' quantization and both attention kernels' dequantization,
against plain torch (a reference quantizer and fp32 attention on the dequantized K/V).

Scale per token and KV head, fp16, symmetric: s = fp16(max|x| / 127), code = round(x / s).
"""

import math

import pytest
import torch

from tests.kernels.dtypes import bf16
from tests.kernels.test_attention import ref_attention
from tests.kernels.test_elementwise import fused_rotary_inputs
from tinyserve.kernels import (
    apply_rotary,
    context_attention_paged,
    rotary_and_write_kv,
    token_attention_paged,
    write_kv_cache,
)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]  # the writes load, then work in fp32


def ref_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Dh] -> (int8 codes [..., Dh], fp16 scales [...])."""
    scale = (x.float().abs().amax(-1) / 127).half()
    s = scale.float()[..., None]
    codes = torch.where(s > 0, torch.round(x.float() / torch.where(s > 0, s, 1.0)), 0.0)
    return codes.clamp(-127, 127).to(torch.int8), scale


def dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None]


def empty_int8_cache(num_blocks, block_size, Hk, Dh, device):
    kc = torch.full((num_blocks, block_size, Hk, Dh), 5, dtype=torch.int8, device=device)
    ks = torch.full((num_blocks, block_size, Hk), 9.0, dtype=torch.float16, device=device)
    return kc, kc.clone(), ks, ks.clone()


def assert_codes_match(codes, scale, x):
    """Scales exactly the reference's; codes equal or (a tie decided by 1 / s vs / s) one off;
    the dequantized value within half a step of x."""
    ref_codes, ref_scale = ref_quantize(x)
    assert torch.equal(scale, ref_scale)
    diff = (codes.int() - ref_codes.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-2
    err = (dequant(codes, scale) - x.float()).abs()
    assert (err <= scale.float()[..., None] * 0.5 + 1e-6 + 1e-3 * x.float().abs()).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,Hk,Dh,block_size", [(1, 4, 8, 16), (37, 2, 64, 16), (100, 3, 24, 8),
                                                (9, 1, 128, 16)])
def test_int8_write_through_slot_mapping(device, dtype, T, Hk, Dh, block_size):
    g = torch.Generator().manual_seed(T * Hk + Dh)
    num_blocks = 2 * (T // block_size + 2)
    Hq = 2 * Hk
    qkv = (torch.randn(T, (Hq + 2 * Hk) * Dh, generator=g) * 3).to(device, dtype)
    k = qkv[:, Hq * Dh: (Hq + Hk) * Dh].view(T, Hk, Dh)
    v = qkv[:, (Hq + Hk) * Dh:].view(T, Hk, Dh)
    if T > 3:
        v[2] = 0  # an all-zero vector: scale 0, codes 0
        k[3, 0, :] = 1e-3  # a tiny constant vector
    kc, vc, ks, vs = empty_int8_cache(num_blocks, block_size, Hk, Dh, device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(device)
    slots[1::5] = -1
    write_kv_cache(k, v, kc, vc, slots, ks, vs)
    keep = slots >= 0
    for codes, scale, x in ((kc, ks, k), (vc, vs, v)):
        assert_codes_match(codes.view(-1, Hk, Dh)[slots[keep]], scale.view(-1, Hk)[slots[keep]],
                           x[keep])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[keep]] = True
    assert (kc.view(-1, Hk, Dh)[~written] == 5).all() and (vs.view(-1, Hk)[~written] == 9).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,Hq,Hk,Dh", [(1, 8, 4, 8), (70, 8, 2, 24), (3, 32, 8, 128)])
def test_fused_rotary_int8_write_equals_rotary_then_quantize(device, dtype, T, Hq, Hk, Dh):
    """The fused kernel quantizes the rotated k and the raw v it holds in registers: the same
    codes as apply_rotary then the int8 write (fp16 / bf16: the unfused path rounds k to the
    dtype first, so a code may differ by one and k's scale by that rounding, 2^-11 / 2^-8)."""
    qkv, cos, sin, pos, slots, views = fused_rotary_inputs(T, Hq, Hk, Dh, dtype, device)
    ref_qkv = qkv.clone()
    rq, rk, rv = views(ref_qkv)
    apply_rotary(rq, rk, pos, cos, sin)
    ref = empty_int8_cache(16, 8, Hk, Dh, device)
    write_kv_cache(rk, rv, ref[0], ref[1], slots, ref[2], ref[3])
    got = empty_int8_cache(16, 8, Hk, Dh, device)
    q, k, v = views(qkv)
    rotary_and_write_kv(q, k, v, pos, cos, sin, got[0], got[1], slots, got[2], got[3])
    assert torch.equal(q, rq)
    if dtype == torch.float32:
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    else:
        assert (got[0].int() - ref[0].int()).abs().max() <= 1
        assert torch.equal(got[1], ref[1]) and torch.equal(got[3], ref[3])
        rtol = 2e-3 if dtype == torch.float16 else 8e-3
        torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=rtol, atol=0)


def make_paged_int8(seq_lens, Hk, Dh, block_size, device, seed):
    """Quantized random K/V over shuffled blocks, and each sequence's dequantized dense K/V."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # per-token magnitudes spread over 1.5 decades: scales that really differ by row
    mag = torch.logspace(-1, 0.5, num_blocks * block_size)[torch.randperm(num_blocks * block_size,
                                                                        generator=g)]
    mag = mag.view(num_blocks, block_size, 1, 1)
    kc, ks = ref_quantize(torch.randn(num_blocks, block_size, Hk, Dh, generator=g) * mag)
    vc, vs = ref_quantize(torch.randn(num_blocks, block_size, Hk, Dh, generator=g) * mag)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    dense = []
    for b, nb in enumerate(blocks_per_seq):
        ids = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        n = seq_lens[b]
        dense.append((dequant(kc[ids], ks[ids]).reshape(-1, Hk, Dh)[:n],
                      dequant(vc[ids], vs[ids]).reshape(-1, Hk, Dh)[:n]))
    caches = tuple(t.to(device) for t in (kc, vc, ks, vs))
    return caches, tables.to(device), dense


# (dtype, atol, rtol): against fp32 attention over the same dequantized values; bf16 codes
# go to a bf16 tl.dot (GPU only), and bf16's step is ~8x fp16's
DTYPES = [(torch.float32, 2e-5, 1e-4), (torch.float16, 1e-2, 1e-2), bf16(5e-2, 5e-2, math=True)]
SHAPES = [
    # (seq_lens / q_lens+ctx, Hq, Hk, Dh, block_size); Hk = 1 takes the scale-folding path
    ([5], 8, 4, 8, 16),
    ([40, 3, 70], 8, 2, 64, 16),
    ([13, 29], 8, 1, 128, 8),
]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("seq_lens,Hq,Hk,Dh,block_size", SHAPES)
@pytest.mark.parametrize("split", [None, (32, 16)])
def test_decode_attention_over_int8_cache(device, dtype, atol, rtol, seq_lens, Hq, Hk, Dh,
                                          block_size, split):
    split_size, block_n = split or (None, None)
    (kc, vc, ks, vs), tables, dense = make_paged_int8(seq_lens, Hk, Dh, block_size, device,
                                                      seed=sum(seq_lens) + Dh)
    B = len(seq_lens)
    q = torch.randn(B, Hq, Dh, generator=torch.Generator().manual_seed(B)).to(device, dtype)
    out = token_attention_paged(q, kc, vc, tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                max(seq_lens), split_size=split_size, block_n=block_n,
                                k_scale=ks, v_scale=vs)
    assert out.dtype == dtype
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b: b + 1], *dense[b], torch.tensor([n - 1], device=device))
        torch.testing.assert_close(out[b: b + 1].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens,Hq,Hk,Dh,block_size", [
    ([5], [0], 8, 4, 8, 16),
    ([40, 3], [9, 100], 8, 2, 64, 16),
    ([13, 29], [31, 2], 4, 1, 128, 8),
])
def test_prefill_attention_over_int8_cache(device, dtype, atol, rtol, q_lens, ctx_lens, Hq, Hk,
                                           Dh, block_size):
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    (kc, vc, ks, vs), tables, dense = make_paged_int8(seq_lens, Hk, Dh, block_size, device,
                                                      seed=sum(seq_lens) * 7 + Dh)
    T = sum(q_lens)
    q = torch.randn(T, Hq, Dh, generator=torch.Generator().manual_seed(T)).to(device, dtype)
    q_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                           device=device)
    out = context_attention_paged(q, kc, vc, tables,
                                  torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                  q_start, max(q_lens), k_scale=ks, v_scale=vs)
    for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
        s = int(q_start[b])
        ref = ref_attention(q[s: s + ql], *dense[b], torch.arange(n - ql, n, device=device))
        torch.testing.assert_close(out[s: s + ql].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("magnitude", [1e-3, 1e-4])
def test_fp16_small_values_through_the_scale_folding_path(device, magnitude):
    """One KV head (the GPU's path: scales folded into p): V values of 1e-4 give scales near
    1e-6, whose products with p would be fp16 subnormals without the tile normalisation."""
    seq_lens, Hq, Hk, Dh = [200, 37], 4, 1, 64
    g = torch.Generator().manual_seed(3)
    nb = 32
    kc, ks = ref_quantize(torch.randn(nb, 16, Hk, Dh, generator=g))
    vc, vs = ref_quantize(torch.randn(nb, 16, Hk, Dh, generator=g) * magnitude)
    tables = torch.arange(nb, dtype=torch.int32).view(2, 16)
    q = torch.randn(2, Hq, Dh, generator=g).half()
    out = token_attention_paged(q.to(device), kc.to(device), vc.to(device), tables.to(device),
                                torch.tensor(seq_lens, device=device), 200,
                                k_scale=ks.to(device), v_scale=vs.to(device))
    k, v = dequant(kc, ks).view(2, 256, Hk, Dh), dequant(vc, vs).view(2, 256, Hk, Dh)
    for b, n in enumerate(seq_lens):
        ref = ref_attention(q[b: b + 1], k[b, :n], v[b, :n], torch.tensor([n - 1]))
        err = (out[b: b + 1].float().cpu() - ref).abs().max() / ref.abs().max()
        assert err < 3e-3, err


def test_huge_values_clip_instead_of_becoming_nan(device):
    k = torch.full((1, 1, 8), 1e7, device=device)
    kc, vc, ks, vs = empty_int8_cache(1, 16, 1, 8, device)
    write_kv_cache(k, k.clone(), kc, vc, torch.zeros(1, dtype=torch.int64, device=device), ks, vs)
    assert ks[0, 0, 0] == 65504 and kc[0, 0, 0].eq(127).all()


def test_int8_cache_argument_errors(device):
    kc = torch.zeros(2, 16, 2, 8, dtype=torch.int8, device=device)
    ks = torch.zeros(2, 16, 2, dtype=torch.float16, device=device)
    q = torch.zeros(1, 4, 8, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        token_attention_paged(q, kc, kc.clone(), table, one, 1)
    with pytest.raises(ValueError, match="fp16"):
        token_attention_paged(q, kc, kc.clone(), table, one, 1, k_scale=ks.float(), v_scale=ks)
    with pytest.raises(ValueError, match="int8 cache only"):
        fc = torch.zeros(2, 16, 2, 8, device=device)
        token_attention_paged(q, fc, fc.clone(), table, one, 1, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, Hk\]"):
        write_kv_cache(torch.zeros(1, 2, 8, device=device), torch.zeros(1, 2, 8, device=device),
                       kc, kc.clone(), one.long(), ks[:, :8], ks)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES[:2])
@pytest.mark.parametrize("split", [None, (32, 16)])
def test_sinks_and_a_window_over_an_int8_cache(device, dtype, atol, rtol, split):
    """gpt-oss's shape of attention (sinks, a window on alternate layers) over int8 K/V:
    decode with one split and several, and prefill."""
    from tests.kernels.test_attention import ref_attention_ext

    split_size, block_n = split or (None, None)
    seq_lens, Hq, Hk, Dh, window = [9, 150], 8, 2, 64, 40
    (kc, vc, ks, vs), tables, dense = make_paged_int8(seq_lens, Hk, Dh, 16, device, seed=77)
    sinks = (torch.randn(Hq, generator=torch.Generator().manual_seed(3)) * 3).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, Hq, Dh, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    out = token_attention_paged(q, kc, vc, tables, lens, max(seq_lens), split_size=split_size,
                                block_n=block_n, k_scale=ks, v_scale=vs, window=window,
                                sinks=sinks)
    for b, n in enumerate(seq_lens):
        ref = ref_attention_ext(q[b:b + 1], *dense[b], torch.tensor([n - 1], device=device),
                                window, sinks=sinks)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=atol, rtol=rtol)
    q_lens = [4, 30]
    qp = torch.randn(sum(q_lens), Hq, Dh, generator=torch.Generator().manual_seed(5)).to(
        device, dtype)
    q_start = torch.tensor([0, 4, 34], dtype=torch.int32, device=device)
    out = context_attention_paged(qp, kc, vc, tables, lens, q_start, max(q_lens), k_scale=ks,
                                  v_scale=vs, window=window, sinks=sinks)
    for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
        s = int(q_start[b])
        ref = ref_attention_ext(qp[s:s + ql], *dense[b], torch.arange(n - ql, n, device=device),
                                window, sinks=sinks)
        torch.testing.assert_close(out[s:s + ql].float(), ref, atol=atol, rtol=rtol)
