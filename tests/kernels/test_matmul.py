"""matmul and int8 dequant-matmul against float32 torch references."""

import pytest
import torch

from tinyserve.kernels import int8_matmul, matmul

SHAPES = [(1, 64, 64), (5, 172, 64), (37, 513, 200), (130, 100, 300), (3, 1000, 17)]


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-5),
                                             (torch.float16, 2e-2, 2e-3)])
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


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-5),
                                             (torch.float16, 3e-2, 3e-3)])
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
