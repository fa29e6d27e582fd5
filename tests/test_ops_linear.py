"""The skinny projection kernel (`tandem/ops/linear.py`) against F.linear: the interpreter at small sizes on the
CPU (fp32, rows and outputs that fill no tile, K not a multiple of the K step, a row-strided input view, K split
over programs), and the 35B-A3B's router | gate and GDN b | a at decode and verify rows in bf16 on the GPU, with
the dispatch's choice."""

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import linear
from tandem.ops.triton_utils import zeroed_counters


@pytest.mark.parametrize("M,N,K", [(1, 1, 64), (5, 16, 200), (17, 33, 128), (40, 70, 256), (100, 257, 64)])
def test_skinny_kernel_cpu_interpreter(M, N, K):
    if torch.cuda.is_available():
        pytest.skip("the interpreter case runs where there is no GPU")
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K + 3, generator=g)[:, :K]  # rows K + 3 apart
    w = torch.randn(N, K, generator=g)
    want = (x.double() @ w.double().T).float()
    counters = zeroed_counters("split-K tiles", torch.device("cpu"), 1, 4096)
    # the default, a benchmark's wider N and narrower K tile, and K split in two or three (the last program of a
    # tile adds the partials, and leaves its counter at zero for the next launch: the same bits again)
    for tiles in (None, (32, 64, 4, 2, 1), (16, 64, 4, 2, 2), (16, 32, 4, 2, 3)):
        got = linear.skinny_linear_triton(x, w, tiles)
        assert got.shape == (M, N)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not counters.any() and torch.equal(linear.skinny_linear_triton(x, w, tiles), got)


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
    for out in (got, linear.skinny_linear_triton(x, w, (16, 128, 4, 4, 8))):  # the default, and K split in 8
        assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
        assert ((out.double() - want).abs() / (x.double().abs() @ w.double().abs().T)).max() <= 2**-7
