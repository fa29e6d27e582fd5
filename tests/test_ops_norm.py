"""Norm kernels: Triton and torch reference against fp64 maths; on the GPU also in bf16."""

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import norm

def fp64_rms_norm_1p(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def fp64_gated(x, z, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z.double())


def cases(device, dtype):
    g = torch.Generator().manual_seed(0)
    for rows, dim in [(1, 16), (7, 48), (33, 128)]:  # 48: a width that is not a power of two
        yield (torch.randn(rows, dim, generator=g).to(device, dtype), torch.randn(rows, dim, generator=g).to(device, dtype),
               torch.randn(dim, generator=g).to(device, dtype))


def check(device, dtype, tol):
    for x, z, w in cases(device, dtype):
        for impl in (norm.rms_norm_1p_triton, norm.rms_norm_1p_torch):
            assert (impl(x, w, 1e-6).double() - fp64_rms_norm_1p(x, w, 1e-6)).abs().max() <= tol
        parts = torch.stack([z, x * 0.5, z * w], 1)  # a MoE block's per-expert outputs [T, 3, H]
        for impl in (norm.add_rms_norm_1p_triton, norm.add_rms_norm_1p_torch):  # z as the residual delta
            total, normed = impl(x, z, w, 1e-6)
            assert torch.equal(total, x + z)  # rounded once to the dtype, as the unfused add
            assert (normed.double() - fp64_rms_norm_1p(total, w, 1e-6)).abs().max() <= tol
            total, normed = impl(x, parts, w, 1e-6)  # the parts summed first, rounded once, as sum(1)
            assert torch.equal(total, x + parts.sum(1))
            assert (normed.double() - fp64_rms_norm_1p(total, w, 1e-6)).abs().max() <= tol
        for impl in (norm.gated_rms_norm_triton, norm.gated_rms_norm_torch):
            assert (impl(x, z, w, 1e-6).double() - fp64_gated(x, z, w, 1e-6)).abs().max() <= tol
    # the GDN layout: [T, heads, n], the gate a strided view into a wider projection output (read in place); 37
    # rows of 16 values: programs of 32 rows, the last one partly masked
    g = torch.Generator().manual_seed(1)
    T, heads, n = 37, 3, 16
    x = torch.randn(T, heads, n, generator=g).to(device, dtype)
    proj = torch.randn(T, 5 + heads * n, generator=g).to(device, dtype)
    z, w = proj[:, 5:].view(T, heads, n), torch.randn(n, generator=g).to(device, dtype)
    assert not z.is_contiguous()
    for impl in (norm.gated_rms_norm_triton, norm.gated_rms_norm_torch):
        out = impl(x, z, w, 1e-6)
        assert out.shape == x.shape and (out.double() - fp64_gated(x, z, w, 1e-6)).abs().max() <= tol


def test_norm_kernels_cpu_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    check("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_norm_kernels_gpu():
    check("cuda", torch.float32, 1e-5)
    check("cuda", torch.bfloat16, 0.1)  # bf16: 8 bits of mantissa on values of size ~3
