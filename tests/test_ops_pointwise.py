"""Fused pointwise kernels: Triton and torch reference against fp64 maths, on strided views like the model's (the
parts of a fused projection's output); in bf16 both must also agree to within the rounding they share."""

import pytest
import torch

from tandem.ops import pointwise


def fp64_silu_mul(g, u):
    g = g.double()
    return g * torch.sigmoid(g) * u.double()


def fp64_sigmoid_gate(x, gate):
    return x.double() * torch.sigmoid(gate.double().reshape(x.shape))


def fp64_gdn_gates(a, b, a_log, dt_bias):
    x = a.double() + dt_bias.double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    return -a_log.double().exp() * softplus, torch.sigmoid(b.double())


def fp64_gated_sum(parts, shared, logit):
    return parts.double().sum(1) + torch.sigmoid(logit.double()) * shared.double()


def fused_output(rows, widths, device, dtype, seed, scale=1.0):
    """Views of one [rows, sum(widths)] tensor, as `_FusedProjections.project` returns them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, sum(widths), generator=g) * scale).to(device, dtype).split(widths, dim=-1)


def check(device, dtype, tol):
    for rows, width, nv, top_k in [(1, 48, 8, 1), (7, 1100, 32, 8), (33, 64, 5, 3)]:  # 1100: two column blocks
        gate, up, b, a, logit = fused_output(rows, [width, width, nv, nv, 1], device, dtype, rows, scale=4.0)
        a_log = torch.randn(nv, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        dt_bias = torch.randn(nv, generator=torch.Generator().manual_seed(2)).to(device, dtype) * 10  # past 20 too
        parts = torch.randn(rows, top_k, width, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        shared = torch.randn(rows, width, generator=torch.Generator().manual_seed(4)).to(device, dtype)
        want_g, want_beta = fp64_gdn_gates(a, b, a_log, dt_bias)
        heads = gate.view(rows, 4, width // 4)  # a [T, heads, head_dim] view with a row stride of its own
        outs = {}
        for name, impls in (("triton", (pointwise.silu_mul_triton, pointwise.gdn_gates_triton,
                                        pointwise.gated_sum_triton, pointwise.sigmoid_gate_triton)),
                            ("torch", (pointwise.silu_mul_torch, pointwise.gdn_gates_torch,
                                       pointwise.gated_sum_torch, pointwise.sigmoid_gate_torch))):
            silu_mul, gdn_gates, gated_sum, sigmoid_gate = impls
            gated = sigmoid_gate(shared, heads)
            want = fp64_sigmoid_gate(shared, heads)
            assert gated.dtype == dtype and ((gated.double() - want).abs() <= tol * (1 + want.abs())).all()
            act = silu_mul(gate, up)
            g, beta = gdn_gates(a, b, a_log, dt_bias)
            total = gated_sum(parts, shared, logit)
            assert act.dtype == dtype and beta.dtype == dtype and g.dtype == torch.float32
            want = fp64_silu_mul(gate, up)
            assert ((act.double() - want).abs() <= tol * (1 + want.abs())).all()
            assert ((g.double() - want_g).abs() <= 1e-5 * (1 + want_g.abs())).all()
            assert ((beta.double() - want_beta).abs() <= tol).all()
            want = fp64_gated_sum(parts, shared, logit)
            assert ((total.double() - want).abs() <= tol * (top_k + 1) * (1 + want.abs())).all()
            outs[name] = (act, g, beta, total, gated)
        # same roundings in both paths: at most one unit in the last place apart in the model dtype
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
        for got, ref in zip(outs["triton"], outs["torch"]):
            assert ((got.double() - ref.double()).abs() <= ulp * (1 + ref.double().abs())).all()


def test_pointwise_kernels_cpu_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    check("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_pointwise_kernels_gpu():
    check("cuda", torch.bfloat16, 2 ** -7)
