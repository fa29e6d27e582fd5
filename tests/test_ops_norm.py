"""Norm kernels: Triton and torch reference against fp64 maths; on the GPU also in bf16. And the e4m3 groups the
norms (and the attention output gate and the SwiGLU) write for the FP8 GEMMs that read their output."""

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import fp8, norm, pointwise

def fp64_rms_norm_1p(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def fp64_gated(x, z, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z.double())


def cases(device, dtype):
    g = torch.Generator().manual_seed(0)
    for rows, dim in [(1, 16), (7, 48), (33, 128)]:  # 48: a width that is not a power of two
        x, residual = (torch.randn(rows, dim, generator=g).to(device, dtype) for _ in range(2))
        yield x, residual, torch.randn(dim, generator=g).to(device, dtype)


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
        # the model's layout: heads side by side in [T, heads * n], z the projection's columns as they are
        flat = impl(x.view(T, heads * n), proj[:, 5:], w, 1e-6)
        assert flat.shape == (T, heads * n) and torch.equal(flat, out.view(T, heads * n))


def check_fp8_groups(device, dtype):
    """With `group`, each kernel's output is unchanged, and the e4m3 groups it hangs on it are bit for bit the
    reference quantisation (`quantize_block_fp8`, per token and group) of that output, as rows of the output's
    last dimension (the GDN norm's output as [T, heads, n] or [T, heads * n]); its FP8 readers take them, and
    quantise any other tensor themselves."""
    g = torch.Generator().manual_seed(2)
    x, z = (torch.randn(5, 64, generator=g).to(device, dtype) * 3 for _ in range(2))
    w = torch.randn(64, generator=g).to(device, dtype)
    parts = torch.randn(5, 9, 64, generator=g).to(device, dtype)
    heads = torch.randn(5, 4, 16, generator=g).to(device, dtype)
    gate = torch.randn(5, 4, 16, generator=g).to(device, dtype)
    runs = [(16, lambda gr: norm.rms_norm_1p_triton(x, w, 1e-6, gr)),
            (32, lambda gr: norm.add_rms_norm_1p_triton(x, z, w, 1e-6, gr)[1]),
            (16, lambda gr: norm.add_rms_norm_1p_triton(x, parts, w, 1e-6, gr)[1]),
            (16, lambda gr: norm.gated_rms_norm_triton(heads, gate, w[:16], 1e-6, gr)),  # [T, heads, n]
            (16, lambda gr: norm.gated_rms_norm_triton(heads.view(5, 64), gate.view(5, 64), w[:16], 1e-6, gr)),
            (32, lambda gr: pointwise.sigmoid_gate_triton(x.contiguous(), gate, block=32, group=gr)),  # 2 programs
            (32, lambda gr: pointwise.silu_mul_triton(x, z, block=64, group=gr))]  # 2 groups a program
    for group, run in runs:
        plain, out = run(None), run(group)
        assert torch.equal(out, plain)
        q, s = fp8.activation_groups(out, group)
        want_q, want_s = fp8.quantize_block_fp8(plain.reshape(-1, plain.shape[-1]), (1, group))  # torch's
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        assert q.data_ptr() == fp8.activation_groups(out, group)[0].data_ptr()  # the norm's: no new launch
        assert fp8.activation_groups(plain, group)[0].data_ptr() != q.data_ptr()
        other = out[1:]  # another tensor (a view of the output): quantised on the spot
        oq, os_ = fp8.activation_groups(other, group)
        assert oq.data_ptr() != q.data_ptr()
        assert torch.equal(os_, fp8.quantize_block_fp8(other.reshape(-1, other.shape[-1]), (1, group))[1])
    # the GDN out projection's input: the norm's [T, heads * n] output has the groups of its own rows, also
    # groups of several heads (two of 16 values here, as two GDN heads of 64 in a 128-group)
    gated = norm.gated_rms_norm_triton(heads.view(5, 64), gate.view(5, 64), w[:16], 1e-6, 32)
    q, s = fp8.activation_groups(gated, 32)
    want_q, want_s = fp8.quantize_block_fp8(gated, (1, 32))
    assert s.shape == (5, 2) and torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # 48 channels (not a power of two) or a group that does not divide them: no groups written, readers quantise
    for x_odd, group in ((torch.randn(3, 48, generator=g).to(device, dtype), 16), (x, 128)):
        out = norm.rms_norm_1p_triton(x_odd, w[: x_odd.shape[1]], 1e-6, group)
        assert not hasattr(out, fp8._GROUPS_ATTR)
    assert not hasattr(pointwise.sigmoid_gate_triton(x, gate, block=16, group=32), fp8._GROUPS_ATTR)  # split groups


def test_norm_kernels_cpu_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    check("cpu", torch.float32, 1e-5)
    check_fp8_groups("cpu", torch.float32)


@pytest.mark.gpu
def test_norm_kernels_gpu():
    check("cuda", torch.float32, 1e-5)
    check("cuda", torch.bfloat16, 0.1)  # bf16: 8 bits of mantissa on values of size ~3
    check_fp8_groups("cuda", torch.bfloat16)
