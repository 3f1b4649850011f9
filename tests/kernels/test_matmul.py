"""matmul and int8 dequant-matmul against float32 torch references."""

import pytest
import torch

from tests.kernels.dtypes import bf16
from tinyserve.kernels import int8_matmul, matmul

SHAPES = [(1, 64, 64), (5, 172, 64), (37, 513, 200), (130, 100, 300), (3, 1000, 17)]
# (dtype, atol, rtol) for outputs up to ~60 (K <= 300 products of N(0, 1) values), rounded to
# the dtype by kernel and reference alike: a GPU's other summation order may round one step
# the other way (fp16 ~2^-10 relative, bf16 ~2^-7). bf16 tiles go through a bf16 tl.dot
# (and int8 weights through an int -> bf16 cast): GPU only.
DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.float16, 2e-2, 2e-3), bf16(5e-2, 1.6e-2, math=True)]
INT8_DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.float16, 3e-2, 3e-3),
               bf16(5e-2, 1.6e-2, math=True)]
EPILOGUE_DTYPES = [(torch.float32, 2e-4, 1e-5), (torch.float16, 3e-2, 3e-3),
                   bf16(5e-2, 1.6e-2, math=True)]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matmul(device, dtype, atol, rtol, M, N, K):
    g = torch.Generator().manual_seed(M * N + K)
    a = torch.randn(M, K, generator=g).to(device, dtype)
    w = torch.randn(N, K, generator=g).to(device, dtype)
    ref = (a.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(matmul(a, w), ref, atol=atol, rtol=rtol)


def test_matmul_strided_a_and_out_dtype(device):
    a = torch.randn(20, 96, device=device)[:, 10:74]  # a strided view: row stride 96
    w = torch.randn(33, 64, device=device)
    out = torch.empty(20, 33, device=device)
    matmul(a, w, out=out)
    torch.testing.assert_close(out, a @ w.T, atol=1e-4, rtol=1e-5)


def test_matmul_rows_are_batch_invariant(device):
    """A row's result must not depend on how many other rows share the call."""
    # pins: a row ignores its tile's other rows and its place there (fixed tiles, K order; order-stable dot)
    a = torch.randn(70, 80, device=device)
    w = torch.randn(90, 80, device=device)
    full = matmul(a, w)
    assert torch.equal(matmul(a[3:4], w)[0], full[3])
    assert torch.equal(matmul(a[60:], w), full[60:])


def quantize(w):
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8), scale


@pytest.mark.parametrize("dtype,atol,rtol", INT8_DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_int8_matmul(device, dtype, atol, rtol, M, N, K):
    g = torch.Generator().manual_seed(M + N * K)
    a = torch.randn(M, K, generator=g).to(device, dtype)
    w_q, scale = quantize(torch.randn(N, K, generator=g))
    w_q, scale = w_q.to(device), scale.to(device)
    ref = (a.float() @ (w_q.float() * scale[:, None]).T).to(dtype)
    torch.testing.assert_close(int8_matmul(a, w_q, scale), ref, atol=atol, rtol=rtol)


def test_int8_matmul_rejects_float_weights(device):
    with pytest.raises(ValueError, match="int8"):
        int8_matmul(torch.randn(2, 4, device=device), torch.randn(3, 4, device=device),
                    torch.ones(3, device=device))


def test_matmul_rejects_mismatched_inner_size(device):
    with pytest.raises(ValueError, match="inner sizes"):
        matmul(torch.randn(2, 4, device=device), torch.randn(3, 5, device=device))


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("M,N,K", [(1, 64, 640), (5, 172, 700), (70, 100, 1000)])
def test_split_k_matches_the_reference_fp_and_int8(device, split, M, N, K):
    """Split-K (K cut into whole tiles per split, partials summed in a fixed order, the int8
    scale applied after the sum) against the torch reference; K is never a multiple here."""
    g = torch.Generator().manual_seed(M + N + K + split)
    a = torch.randn(M, K, generator=g).to(device)
    w = torch.randn(N, K, generator=g).to(device)
    torch.testing.assert_close(matmul(a, w, split_k=split), a @ w.T, atol=2e-4, rtol=1e-5)
    w_q, scale = quantize(w.cpu())
    w_q, scale = w_q.to(device), scale.to(device)
    ref = a @ (w_q.float() * scale[:, None]).T
    torch.testing.assert_close(int8_matmul(a, w_q, scale, split_k=split), ref, atol=2e-4, rtol=1e-5)
    half = a.half()
    torch.testing.assert_close(matmul(half, w.half(), split_k=split).float(), a @ w.T,
                               atol=0.1, rtol=2e-2)


def test_split_k_rows_are_batch_invariant(device):
    # pins: a split-K row's partial sums and their order depend on (N, K, split), never on M
    a = torch.randn(70, 1000, device=device)
    w = torch.randn(90, 1000, device=device)
    full = matmul(a, w, split_k=4)
    assert torch.equal(matmul(a[3:4], w, split_k=4)[0], full[3])
    assert torch.equal(matmul(a[60:], w, split_k=4), full[60:])


def test_split_k_policy_fills_the_sms_by_n_and_k_only():
    from tinyserve.kernels.matmul import split_k_for

    sms = 132  # H100 / H200
    assert split_k_for(4096, 4096, 128, 64, sms) == 4  # o_proj: 32 column tiles -> 128 programs
    assert split_k_for(4096, 14336, 128, 64, sms) == 4  # down_proj
    assert split_k_for(6144, 4096, 128, 64, sms) == 2  # fused qkv: 48 tiles
    assert split_k_for(28672, 4096, 128, 64, sms) == 1  # gate_up: already 224 tiles
    assert split_k_for(128256, 4096, 128, 64, sms) == 1  # lm_head
    assert split_k_for(4096, 512, 128, 64, sms) == 2  # short K: >= 4 K tiles per split
    assert split_k_for(64, 64, 128, 64, sms) == 1


@pytest.mark.parametrize("w_int8", [False, True])
def test_split_k_chunks_in_one_program_equal_separate_programs_bit_for_bit(device, w_int8):
    """Many tiles (prefill) run the K chunks one after another in each program; few tiles
    (decode) run them in separate programs and a sum kernel adds them: the same fp32 sums in
    the same order, so a row is bit-identical either way (and batch invariant)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(37, 700, generator=g).to(device)
    w = torch.randn(90, 700, generator=g)
    if w_int8:
        w_q, scale = quantize(w)
        run = lambda **kw: int8_matmul(a, w_q.to(device), scale.to(device), **kw)  # noqa: E731
    else:
        run = lambda **kw: matmul(a, w.to(device), **kw)  # noqa: E731
    for split in (2, 3, 5):
        assert torch.equal(run(split_k=split, split_grid=True), run(split_k=split, split_grid=False))


def test_split_k_with_the_gpu_tiles_and_grouped_grid(device, monkeypatch):
    """The GPU's launch layout (grouped grid: the K chunk is program_id(1); fp32 32x64x32
    tiles, fp16 64x128x64, int8 weights 128-wide K tiles) run through the interpreter against
    the reference, chunks in separate programs and in one."""
    import sys

    mm = sys.modules["tinyserve.kernels.matmul"]  # (the package re-exports the function)
    monkeypatch.setattr(mm, "INTERPRET", False)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(70, 600, generator=g).to(device)
    w = torch.randn(150, 600, generator=g)
    w_q, scale = quantize(w)
    w, w_q, scale = w.to(device), w_q.to(device), scale.to(device)
    ref_fp, ref_q = a @ w.T, a @ (w_q.float() * scale[:, None]).T
    for dtype, tol in ((torch.float32, dict(atol=2e-4, rtol=1e-5)),
                       (torch.float16, dict(atol=0.1, rtol=2e-2))):
        x = a.to(dtype)
        for split in (1, 2, 3):
            for grid in (True, False):
                got = matmul(x, w.to(dtype), split_k=split, split_grid=grid)
                torch.testing.assert_close(got.float(), ref_fp, **tol)
                got = int8_matmul(x, w_q, scale, split_k=split, split_grid=grid)
                torch.testing.assert_close(got.float(), ref_q, **tol)


def _epilogue_ref(y: torch.Tensor, bias: torch.Tensor | None, cap: float | None) -> torch.Tensor:
    y = y if bias is None else y + bias.float()
    return y if cap is None else cap * torch.tanh(y / cap)


@pytest.mark.parametrize("dtype,atol,rtol", EPILOGUE_DTYPES)
@pytest.mark.parametrize("split", [(None, None), (2, True), (3, False)])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("M,N,K,cap", [(1, 67, 64, None), (9, 300, 130, 30.0), (33, 96, 96, 5.0)])
def test_bias_and_softcap_epilogue(device, dtype, atol, rtol, split, int8, M, N, K, cap):
    """+ bias[n] then cap * tanh(y / cap), on the fp32 accumulator, in every path: one program
    per tile, K chunks in separate programs (summed by the split-K kernel) or in one."""
    g = torch.Generator().manual_seed(M * 7 + N + K)
    a = torch.randn(M, K, generator=g).to(device, dtype)
    w = torch.randn(N, K, generator=g)
    bias = (torch.randn(N, generator=g) * 3).to(device, dtype)
    split_k, split_grid = split
    if int8:
        w_q, scale = quantize(w)
        w_q, scale = w_q.to(device), scale.to(device)
        ref = a.float() @ (w_q.float() * scale[:, None]).T
        got = int8_matmul(a, w_q, scale, bias=bias, softcap=cap, split_k=split_k,
                          split_grid=split_grid)
    else:
        w = w.to(device, dtype)
        ref = a.float() @ w.float().T
        got = matmul(a, w, bias=bias, softcap=cap, split_k=split_k, split_grid=split_grid)
    torch.testing.assert_close(got, _epilogue_ref(ref, bias, cap).to(dtype), atol=atol, rtol=rtol)


def test_softcap_saturates_without_overflow(device):
    a = torch.full((2, 16), 100.0, device=device)
    w = torch.ones(3, 16, device=device)  # y = 1600: tanh saturates, never inf or nan
    out = matmul(a, w, softcap=30.0)
    torch.testing.assert_close(out, torch.full((2, 3), 30.0, device=device))
    out = matmul(-a, w, softcap=30.0, bias=torch.zeros(3, device=device))
    torch.testing.assert_close(out, torch.full((2, 3), -30.0, device=device))


def test_bad_bias_is_refused(device):
    a, w = torch.randn(2, 16, device=device), torch.randn(3, 16, device=device)
    with pytest.raises(ValueError, match="bias"):
        matmul(a, w, bias=torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="softcap"):
        matmul(a, w, softcap=0.0)
