"""The skinny projection kernel (`tandem/ops/linear.py`) against F.linear: the interpreter at small sizes on the
CPU (fp32, rows and outputs that fill no tile, K not a multiple of the K step, a row-strided input view), and the
35B-A3B's router | gate and GDN b | a at decode and verify rows in bf16 on the GPU, with the dispatch's choice."""

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import linear


@pytest.mark.parametrize("M,N,K", [(1, 1, 64), (5, 16, 200), (17, 33, 128), (40, 70, 256), (100, 257, 64)])
def test_skinny_kernel_cpu_interpreter(M, N, K):
    if torch.cuda.is_available():
        pytest.skip("the interpreter case runs where there is no GPU")
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K + 3, generator=g)[:, :K]  # rows K + 3 apart
    w = torch.randn(N, K, generator=g)
    want = (x.double() @ w.double().T).float()
    for tiles in (None, (32, 64, 4, 2)):  # the default, and a benchmark's wider N and narrower K tile
        got = linear.skinny_linear_triton(x, w, tiles)
        assert got.shape == (M, N)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_cpu_takes_reference():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear.linear(x, w), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 32, 96, 128])
@pytest.mark.parametrize("N", [264, 64])
def test_skinny_gpu(rows, N):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, 2048, device="cuda", generator=g) / 2048**0.5).to(torch.bfloat16)
    got = linear.skinny_linear_triton(x, w)
    assert torch.equal(linear.linear(x, w), got if rows >= linear.SKINNY_MIN_ROWS else F.linear(x, w))
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    assert ((got.double() - want).abs() / (x.double().abs() @ w.double().abs().T)).max() <= 2**-7
