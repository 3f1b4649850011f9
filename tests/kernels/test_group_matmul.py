"""Group-wise dequant-matmuls (int4 codes with zero points or float minimums, int8 codes with
or without minimums) against a float32 torch reference, and the int4 packing helpers.

The reference packer / unpacker here is written independently of the module's (arithmetic on
uint32 values instead of shifts), so a layout mistake in either shows up as a mismatch.
"""

import pytest
import torch

from tests.kernels.dtypes import bf16
from tinyserve.kernels.group_matmul import int4_matmul, int8_group_matmul
from tinyserve.kernels.int4_pack import dequantize_int4, quantize_int4
from tinyserve.kernels.utils import cdiv

# (M, N, K, group_size): N never a multiple of the tile; K / group_size from 1 to 32 groups;
# 96 and 384 are not powers of two (K tiles of 32 and 128 inside each group).
SHAPES = [(1, 96, 128, 32), (3, 200, 256, 64), (17, 1000, 384, 128), (64, 96, 1024, 128),
          (3, 1000, 1024, 32), (17, 200, 384, 384), (3, 96, 384, 96), (1, 200, 256, 128)]
# K not a multiple of G, the last group partial: stories260k's K = 64 and 172 with G = 128, four
# groups of 64 with 8 real columns in the last, and a 24 = 16 + 8 with the smallest group.
AWKWARD_K = [(3, 96, 64, 128), (17, 200, 172, 128), (5, 150, 200, 64), (1, 40, 24, 16)]
# (dtype, atol, rtol): x and the dequantized tile in the dtype, fp32 sums. bf16: a bf16 tl.dot
# and int -> bf16 casts, GPU only (tests/kernels/dtypes.py).
DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.float16, 1e-2, 1e-2), bf16(5e-2, 2e-2, math=True)]


def pack_ref(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] codes in [0, 15] -> [N, K // 8] int32; k = 8 * word + j sits at 16**j."""
    q = q.to(torch.int64)
    words = sum(q[:, j::8] * 16**j for j in range(8))
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack_ref(qweight: torch.Tensor) -> torch.Tensor:
    u = qweight.to(torch.int64) % 2**32  # the word as an unsigned value
    q = torch.stack([(u // 16**j) % 16 for j in range(8)], dim=-1)  # [N, K // 8, 8]
    return q.reshape(qweight.shape[0], -1)


def dequant_ref(qweight, scales, zeros, group_size):
    """[N, K_pad], padding included (tests slice the real K)."""
    q = unpack_ref(qweight).double()
    z = 8.0 if zeros is None else zeros.double().repeat_interleave(group_size, 1)
    return ((q - z) * scales.double().repeat_interleave(group_size, 1)).float()


def random_weight(N, K, G, zeros, dtype, g):
    """Random codes (the padding past K too: only x's mask keeps it out of a sum), scales in
    [0.01, 0.03) and zero points of the requested kind, for ceil(K / G) groups."""
    groups = cdiv(K, G)
    q = torch.randint(0, 16, (N, groups * G), generator=g)
    scales = (0.01 + 0.02 * torch.rand(N, groups, generator=g)).to(dtype)
    if zeros == "int":
        z = torch.randint(0, 16, (N, groups), generator=g).to(torch.uint8)
    elif zeros == "float":  # fractional zero points
        z = 15 * torch.rand(N, groups, generator=g)
    else:
        z = None
    return pack_ref(q), scales, z


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("zeros", ["symmetric", "int", "float"])
@pytest.mark.parametrize("M,N,K,G", SHAPES)
def test_int4_matmul(device, dtype, atol, rtol, zeros, M, N, K, G):
    g = torch.Generator().manual_seed(M + N * K + G)
    qweight, scales, z = random_weight(N, K, G, zeros, dtype, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = x.float() @ dequant_ref(qweight, scales, z, G).T
    y = int4_matmul(x.to(device), qweight.to(device), scales.to(device),
                    None if z is None else z.to(device), G)
    assert y.dtype == dtype and y.shape == (M, N)
    torch.testing.assert_close(y.cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("zeros", ["symmetric", "int"])
@pytest.mark.parametrize("M,N,K,G", AWKWARD_K)
def test_k_not_a_multiple_of_the_group(device, dtype, atol, rtol, zeros, M, N, K, G):
    g = torch.Generator().manual_seed(M + N * K + G)
    qweight, scales, z = random_weight(N, K, G, zeros, dtype, g)
    assert qweight.shape[1] * 8 > K  # codes past K, all random
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = x.float() @ dequant_ref(qweight, scales, z, G)[:, :K].T
    y = int4_matmul(x.to(device), qweight.to(device), scales.to(device),
                    None if z is None else z.to(device), G)
    torch.testing.assert_close(y.cpu().float(), ref, atol=atol, rtol=rtol)


def test_layout_pins_low_nibble_first_and_the_sign_bit(device):
    """W = q exactly (scale 1, zero 0): one code at nibble 5 of word 2 of row 1, one at the
    top nibble (the int32's sign bit) of word 0 of row 3; x picks columns k of W."""
    N, K = 5, 128
    qweight = torch.zeros(N, K // 8, dtype=torch.int32)
    qweight[1, 2] = 1 << 20  # k = 8 * 2 + 5
    qweight[3, 0] = -(1 << 28)  # 0xF0000000: q = 15 at k = 7
    ones, zero = torch.ones(N, 1), torch.zeros(N, 1)
    x = torch.zeros(3, K)
    x[0, 21] = x[1, 7] = x[2, 20] = 1.0
    y = int4_matmul(x.to(device), qweight.to(device), ones.to(device), zero.to(device), K)
    expect = torch.zeros(3, N)
    expect[0, 1], expect[1, 3] = 1.0, 15.0
    assert torch.equal(y.cpu(), expect)


def test_scales_in_fp32_with_fp16_activations_and_transposed_views(device):
    """Any strides for scales / zeros (a loader may keep them [K // G, N]) and for x."""
    g = torch.Generator().manual_seed(7)
    M, N, K, G = 5, 200, 256, 64
    qweight, scales, z = random_weight(N, K, G, "int", torch.float32, g)
    x = torch.randn(M, K + 40, generator=g)[:, 40:].half()  # a strided view
    ref = x.float() @ dequant_ref(qweight, scales, z, G).T
    s_t, z_t = scales.T.contiguous().to(device).T, z.T.contiguous().to(device).T
    y = int4_matmul(x.to(device), qweight.to(device), s_t, z_t, G)
    torch.testing.assert_close(y.cpu().float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("G", [32, 128])
def test_quantize_round_trip(symmetric, G):
    g = torch.Generator().manual_seed(G)
    w = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g)
    w[3, :G] = 0.0  # an all-zero group: no division by zero
    qweight, scales, zeros = quantize_int4(w, G, symmetric)
    assert qweight.shape == (96, 32) and qweight.dtype == torch.int32
    assert scales.shape == (96, 256 // G) and scales.dtype == torch.float32
    assert (zeros is None) == symmetric
    if zeros is not None:
        assert zeros.shape == scales.shape and int(zeros.min()) >= 0 and int(zeros.max()) <= 15
    deq = dequant_ref(qweight, scales, zeros, G)
    assert torch.equal(dequantize_int4(qweight, scales, zeros, G), deq)
    bound = scales.repeat_interleave(G, 1) / 2 * (1 + 1e-5)
    assert ((deq - w).abs() <= bound).all()
    assert torch.equal(deq[3, :G], torch.zeros(G))
    wg = w.view(96, -1, G)  # the step: a group's |max| spans 7.5 steps, or [min, max] 15
    step = wg.abs().amax(-1) * 2 / 15 if symmetric else (wg.amax(-1) - wg.amin(-1)) / 15
    torch.testing.assert_close(scales, step.clamp(min=1e-10))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_a_partial_last_group(symmetric):
    """K = 172, G = 128: the second group has 44 real columns, all positive: its statistics
    come from them (not from the padding), and its padding dequantizes to exactly 0."""
    g = torch.Generator().manual_seed(5)
    N, K, G = 40, 172, 128
    w = torch.randn(N, K, generator=g)
    w[:, G:] = 1 + torch.rand(N, K - G, generator=g)
    qweight, scales, zeros = quantize_int4(w, G, symmetric)
    assert qweight.shape == (N, 256 // 8) and scales.shape == (N, 2)
    real = w[:, G:]
    # (asymmetric ranges include 0, as GPTQ's quantizer has them: this group's starts at 0)
    step = real.abs().amax(-1) * 2 / 15 if symmetric else real.amax(-1) / 15
    torch.testing.assert_close(scales[:, 1], step)
    padded = unpack_ref(qweight)[:, K:]
    zero_code = torch.full((N, 1), 8) if symmetric else zeros[:, 1:].long()
    assert torch.equal(padded, zero_code.expand(N, 256 - K))
    full = dequant_ref(qweight, scales, zeros, G)
    assert torch.equal(full[:, K:], torch.zeros(N, 256 - K))
    deq = dequantize_int4(qweight, scales, zeros, G, k=K)
    assert deq.shape == (N, K) and torch.equal(deq, full[:, :K])
    bound = scales.repeat_interleave(G, 1)[:, :K] / 2 * (1 + 1e-5)  # nothing clips
    assert ((deq - w).abs() <= bound).all()


def test_quantized_linear_is_close_to_the_float_one(device):
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(200, 256, generator=g), torch.randn(3, 256, generator=g)
    qweight, scales, zeros = quantize_int4(w, 64, symmetric=False)
    y = int4_matmul(x.to(device), qweight.to(device), scales.to(device), zeros.to(device), 64)
    bound = x.abs() @ (scales.repeat_interleave(64, 1) / 2).T  # sum_k |x| * s / 2
    assert ((y.cpu() - x @ w.T).abs() <= bound * 1.001 + 1e-4).all()


@pytest.mark.parametrize("K", [640, 300])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_chunks_in_one_program_equal_separate_programs(device, split, K):
    """G=64: chunks of whole groups (K=300: the last chunk ends in padding); the same fp32 sums
    either way, bit for bit."""
    g = torch.Generator().manual_seed(split)
    qweight, scales, z = (t.to(device) for t in random_weight(150, K, 64, "int", torch.float32, g))
    x = torch.randn(37, K, generator=g).to(device)
    ref = x.cpu() @ dequant_ref(qweight.cpu(), scales.cpu(), z.cpu(), 64)[:, :K].T
    grid = int4_matmul(x, qweight, scales, z, 64, split_k=split, split_grid=True)
    inline = int4_matmul(x, qweight, scales, z, 64, split_k=split, split_grid=False)
    assert torch.equal(grid, inline)
    torch.testing.assert_close(grid.cpu(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("K", [256, 172])
def test_rows_are_batch_invariant(device, K):
    g = torch.Generator().manual_seed(3)
    qweight, scales, _ = (t.to(device) if t is not None else t
                          for t in random_weight(90, K, 128, "symmetric", torch.float32, g))
    x = torch.randn(70, K, generator=g).to(device)
    full = int4_matmul(x, qweight, scales)
    assert torch.equal(int4_matmul(x[3:4], qweight, scales)[0], full[3])
    assert torch.equal(int4_matmul(x[60:], qweight, scales), full[60:])


def test_gpu_tiles_and_grouped_grid_through_the_interpreter(device, monkeypatch):
    """The GPU's launch layout (grouped grid, 64x128 tiles, K tiles of min(128, G) for fp16 and
    32 for fp32, split-K in both modes) against the reference; K = 488 ends in a partial group."""
    import sys

    mod = sys.modules["tinyserve.kernels.group_matmul"]
    monkeypatch.setattr(mod, "INTERPRET", False)
    g = torch.Generator().manual_seed(6)
    qweight, scales, z = random_weight(150, 488, 64, "float", torch.float32, g)
    x = torch.randn(70, 488, generator=g)
    ref = x @ dequant_ref(qweight, scales, z, 64)[:, :488].T
    qweight, scales, z = qweight.to(device), scales.to(device), z.to(device)
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-5)),
                       (torch.float16, dict(atol=5e-2, rtol=1e-2))):
        for split, grid in ((1, False), (2, True), (2, False)):
            y = int4_matmul(x.to(device, dtype), qweight, scales, z, 64, split_k=split,
                            split_grid=grid)
            torch.testing.assert_close(y.cpu().float(), ref, **tol)


def _args(**change):
    N, K, G = 8, 128, 32
    args = dict(x=torch.randn(2, K), qweight=torch.zeros(N, K // 8, dtype=torch.int32),
                scales=torch.ones(N, K // G), zeros=None, group_size=G)
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(group_size=48), "not whole groups"),  # 128 % 48
    (dict(group_size=8, scales=torch.ones(8, 16)), "multiple of 16"),
    (dict(qweight=torch.zeros(8, 16, dtype=torch.int64)), "int32"),
    (dict(qweight=torch.zeros(8, 12, dtype=torch.int32)), "inner sizes"),  # 96 < K = 128
    (dict(x=torch.randn(2, 96)), "inner sizes"),  # 96 needs 3 groups of 32, qweight holds 4
    (dict(scales=torch.ones(8, 3)), "scales must be"),
    (dict(scales=torch.ones(8, 4, dtype=torch.int32)), "scales must be fp16"),
    (dict(zeros=torch.zeros(8, 5)), "zeros / mins must be"),
    (dict(x=torch.zeros(2, 128, dtype=torch.int32)), "x must be"),
    (dict(x=torch.randn(128)), r"x must be \[M, K\]"),
])
def test_bad_inputs_raise(change, match):
    with pytest.raises(ValueError, match=match):
        int4_matmul(**_args(**change))


def test_bad_out_and_quantize_inputs_raise():
    with pytest.raises(ValueError, match="out must be"):
        int4_matmul(**_args(), out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_int4(torch.randn(4, 96), group_size=40)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_never_increases_a_groups_error(symmetric):
    """The searched range starts from the plain one and keeps a shrunk one only where it
    lowers the group's squared error: never worse per group, better on heavy-tailed weights."""
    g = torch.Generator().manual_seed(21)
    N, K, G = 64, 200, 64  # a partial last group too
    w = torch.randn(N, K, generator=g) * 0.02
    w[torch.rand(N, K, generator=g) < 0.02] *= 6  # heavy tails: a few outliers per group
    plain = dequantize_int4(*quantize_int4(w, G, symmetric), group_size=G, k=K)
    searched = dequantize_int4(*quantize_int4(w, G, symmetric, clip_search=20), group_size=G, k=K)

    def group_err(d):
        e = torch.nn.functional.pad((d - w) ** 2, (0, 256 - K))
        return e.view(N, 4, G).sum(-1)

    assert (group_err(searched) <= group_err(plain) * (1 + 1e-6) + 1e-12).all()
    assert group_err(searched).sum() < 0.98 * group_err(plain).sum()


@pytest.mark.parametrize("split", [(None, None), (2, True), (2, False)])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_bias_and_softcap_epilogue(device, split, cap):
    """The epilogue matmul.py documents (+ bias, then cap * tanh(y / cap)), in every split mode,
    K = 300 ending in a partial group."""
    g = torch.Generator().manual_seed(11)
    qweight, scales, z = (t.to(device) for t in random_weight(150, 300, 64, "int", torch.float32, g))
    x = torch.randn(9, 300, generator=g).to(device)
    bias = torch.randn(150, generator=g).to(device)
    y = x.cpu() @ dequant_ref(qweight.cpu(), scales.cpu(), z.cpu(), 64)[:, :300].T + bias.cpu()
    ref = y if cap is None else cap * torch.tanh(y / cap)
    got = int4_matmul(x, qweight, scales, z, 64, bias=bias, softcap=cap, split_k=split[0],
                      split_grid=split[1])
    torch.testing.assert_close(got.cpu(), ref, atol=2e-4, rtol=1e-5)


# ---- float minimums (GGUF's Q4_1 / Q4_K: W = q * scale + min) and int8 codes (Q8_0, Q5_*, Q6_K)


def gguf_like(N, K, G, bits, with_mins, dtype, g):
    """Codes as GGUF's formats hold them: int4 in [0, 15]; int8 signed (Q8_0: [-127, 127]) or,
    with minimums, unsigned 5-bit; scales like fp16 block scales, minimums of either sign."""
    groups = cdiv(K, G)
    if bits == 4:
        q = torch.randint(0, 16, (N, groups * G), generator=g)
        codes = pack_ref(q)
    elif with_mins:
        q = torch.randint(0, 32, (N, groups * G), generator=g)
        codes = q.to(torch.int8)
    else:
        q = torch.randint(-127, 128, (N, groups * G), generator=g)
        codes = q.to(torch.int8)
    scales = (0.001 + 0.01 * torch.rand(N, groups, generator=g)).to(dtype)
    mins = (torch.rand(N, groups, generator=g) - 0.5).to(dtype) * 0.1 if with_mins else None
    w = q.double() * scales.double().repeat_interleave(G, 1)
    if mins is not None:
        w = w + mins.double().repeat_interleave(G, 1)
    return codes, scales, mins, w.float()


# (M, N, K, G): SmolLM2's 576 / 1536 with GGUF's 32 and Q6_K's 16, a partial group, one group
GGUF_SHAPES = [(1, 96, 576, 32), (5, 200, 1536, 16), (17, 130, 200, 32), (3, 64, 32, 32)]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("bits,with_mins", [(4, True), (8, False), (8, True)])
@pytest.mark.parametrize("M,N,K,G", GGUF_SHAPES)
def test_gguf_forms(device, dtype, atol, rtol, bits, with_mins, M, N, K, G):
    g = torch.Generator().manual_seed(M * 7 + N + K + G + bits)
    codes, scales, mins, w = gguf_like(N, K, G, bits, with_mins, torch.float32, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = x.float() @ w[:, :K].T
    args = (x.to(device), codes.to(device), scales.to(device))
    m = None if mins is None else mins.to(device)
    if bits == 4:
        y = int4_matmul(*args, group_size=G, mins=m)
    else:
        y = int8_group_matmul(*args, G, mins=m)
    assert y.dtype == dtype and y.shape == (M, N)
    scale = max(1.0, float(ref.abs().max()))  # int8 codes make larger sums
    torch.testing.assert_close(y.cpu().float() / scale, ref / scale, atol=atol, rtol=rtol)


@pytest.mark.parametrize("bits,with_mins", [(4, True), (8, True), (8, False)])
def test_one_group_per_tile_equals_several(device, bits, with_mins):
    """The GPU keeps a K tile inside one group; the interpreter's tiles hold several groups
    (their scales broadcast): the same products, summed in other tiles, so equal to fp32
    rounding."""
    g = torch.Generator().manual_seed(bits)
    codes, scales, mins, w = gguf_like(40, 576, 32, bits, with_mins, torch.float32, g)
    x = torch.randn(6, 576, generator=g).to(device)
    fn = int4_matmul if bits == 4 else int8_group_matmul
    kw = dict(group_size=32, mins=None if mins is None else mins.to(device))
    args = (x, codes.to(device), scales.to(device))
    narrow = fn(*args, **kw, tiles=(64, 64, 32, 1))
    wide = fn(*args, **kw, tiles=(64, 64, 64, 1))
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(wide.cpu(), x.cpu() @ w.T, atol=1e-4, rtol=1e-5)


def test_gguf_forms_with_an_epilogue_and_split_k(device):
    g = torch.Generator().manual_seed(9)
    codes, scales, mins, w = gguf_like(150, 640, 32, 8, True, torch.float32, g)
    x = torch.randn(7, 640, generator=g)
    bias = torch.randn(150, generator=g)
    ref = 3.0 * torch.tanh((x @ w.T + bias) / 3.0)
    dev = [t.to(device) for t in (x, codes, scales, mins, bias)]
    for split, grid in ((1, False), (2, True), (2, False)):
        y = int8_group_matmul(dev[0], dev[1], dev[2], 32, mins=dev[3], bias=dev[4], softcap=3.0,
                              split_k=split, split_grid=grid)
        torch.testing.assert_close(y.cpu(), ref, atol=1e-4, rtol=1e-5)


def test_bad_gguf_form_inputs_raise():
    x, scales = torch.randn(2, 64), torch.ones(8, 2)
    with pytest.raises(ValueError, match="codes must be int8"):
        int8_group_matmul(x, torch.zeros(8, 64, dtype=torch.uint8), scales, 32)
    with pytest.raises(ValueError, match="zeros or mins, not both"):
        int4_matmul(x, torch.zeros(8, 8, dtype=torch.int32), scales, torch.zeros(8, 2), 32,
                    mins=torch.zeros(8, 2))
    with pytest.raises(ValueError, match="zeros / mins must be"):
        int8_group_matmul(x, torch.zeros(8, 64, dtype=torch.int8), scales, 32,
                          mins=torch.zeros(8, 3))
    with pytest.raises(ValueError, match="whole groups or lie inside one"):
        int8_group_matmul(x, torch.zeros(8, 64, dtype=torch.int8), scales, 32,
                          tiles=(16, 16, 48, 1))
