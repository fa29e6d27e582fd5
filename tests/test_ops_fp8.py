"""FP8 W8A8 kernels (tandem/ops/fp8.py, the FP8 branch of tandem/ops/moe.py) against fp64 maths.

Oracle: x's e4m3 values and scales per token and group from `quantize_block_fp8` with a (1, group) block (its
error bound is pinned in test_fp8.py), both operands expanded to fp64 by index arithmetic written here, and
multiplied in fp64. The kernels quantise x themselves, with IEEE-rounded divisions, so they must reproduce those
e4m3 values exactly; what is left is fp32 summation (and the output's rounding to bf16 on the GPU). On the CPU the
kernels run under Triton's interpreter at small sizes with blocks that leave partial tiles, partial scale blocks
and partial groups; on the GPU (-m gpu) at the 35B-A3B sizes with the official 128 x 128 blocks."""

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import fp8, moe
from tandem.ops.fp8 import quantize_block_fp8
from tandem.ops.triton_utils import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                       reason="the CPU interpreter cases run where there is no GPU")


def expand64(q, s, block):
    """e4m3 values times their block's scale, in fp64: element (i, j) takes s[i // b0, j // b1]."""
    rows = torch.arange(q.shape[-2], device=q.device) // block[0]
    cols = torch.arange(q.shape[-1], device=q.device) // block[1]
    return q.double() * s.double().index_select(-2, rows).index_select(-1, cols)


def act64(x, group):
    return expand64(*quantize_block_fp8(x, (1, group)), (1, group))


def weight(n, k, block, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5 * torch.logspace(-1, 1, n)[:, None]  # rows of unequal magnitude
    q, s = quantize_block_fp8(w.to(device), block)
    return q, s


# Summation error per unit of |x| @ |w|: fp32 accumulation (the interpreter, and row tiles under 64 on the GPU,
# which promote every K = 32 step: 3.5e-8 measured on an H100) or Hopper's fast e4m3 accumulation inside each
# 128-wide group (64-row tiles: more than 32 rows, `fp8.dot_mode`; it keeps about 14 bits, 3.2e-5 measured), both
# far below the 2^-4 that quantising the activations to e4m3 costs
FP32_SUM = 1e-5
FAST_SUM = 2**-13


def check_linear(out, x, q, s, block, rtol, sum_tol=FP32_SUM):
    want = act64(x, block[1]) @ expand64(q, s, block).T
    scale = act64(x, block[1]).abs() @ expand64(q, s, block).abs().T  # bounds the summation error
    err = (out.double() - want).abs()
    assert out.dtype == x.dtype and out.shape == want.shape
    assert (err <= rtol * want.abs() + sum_tol * scale + 1e-30).all(), float((err / (scale + 1e-30)).max())


LINEAR_CASES = [  # M, N, K, block, tiles (BLOCK_M, BLOCK_N, K splits, warps, stages)
    (1, 48, 64, (16, 16), (16, 32, 1, 4, 1)),  # a partial N tile
    (5, 40, 80, (16, 16), (16, 32, 2, 4, 1)),  # N not a whole number of scale blocks; 5 groups in 2 splits
    (33, 64, 72, (32, 32), (16, 32, 1, 4, 1)),  # a partial activation group; three M tiles
    (7, 64, 96, (32, 32), (16, 64, 3, 4, 1)),  # a split per group
    (300, 64, 64, (32, 32), (64, 64, 1, 4, 1)),  # prefill rows: the fast-accumulation DOT (`fp8.dot_mode`)
]


@needs_interpreter
@pytest.mark.parametrize("R,K,group", [(3, 80, 16), (5, 72, 32), (2, 16, 16)])
def test_quantize_activations_kernel_cpu_interpreter(R, K, group):
    """The activation quantisation kernel gives `quantize_block_fp8`'s e4m3 values and scales bit for bit,
    including a partial group and an all-zero group; with a device-side row count, the rows before it."""
    x = torch.randn(R, K, generator=torch.Generator().manual_seed(K)) * torch.logspace(-3, 2, K)
    x[0, :group] = 0
    q, s = fp8.quantize_activations_triton(x, group)
    want_q, want_s = quantize_block_fp8(x, (1, group))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    rows = torch.tensor([R - 1], dtype=torch.int32)
    q, s = fp8.quantize_activations_triton(x, group, rows=rows)
    assert torch.equal(q[: R - 1].view(torch.uint8), want_q[: R - 1].view(torch.uint8))
    assert torch.equal(s[: R - 1], want_s[: R - 1])


@needs_interpreter
@pytest.mark.parametrize("M,N,K,block,tiles", LINEAR_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_kernel_cpu_interpreter(M, N, K, block, tiles, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 1, M)[:, None]).to(dtype)
    x[0, : block[1]] = 0  # an all-zero group: the floored scale, exact zeros
    q, s = weight(N, K, block, seed=K)
    out = fp8.w8a8_linear_triton(x, q, s, block, tiles=tiles)
    check_linear(out, x, q, s, block, rtol=2e-6 if dtype == torch.float32 else 2**-8)
    # a split GEMM leaves its tile counters at zero for the next one, and adds its partials in a fixed order
    assert torch.equal(fp8.w8a8_linear_triton(x, q, s, block, tiles=tiles), out)


def test_w8a8_reference_and_dispatch():
    """The torch path (what a CPU tensor takes) against the fp64 oracle, over a leading batch dimension."""
    block = (16, 16)
    q, s = weight(48, 80, block, seed=1)
    x = torch.randn(2, 3, 80, generator=torch.Generator().manual_seed(2))
    out = fp8.w8a8_linear(x, q, s, block)
    assert out.shape == (2, 3, 48)
    check_linear(out.reshape(6, 48), x.reshape(6, 80), q, s, block, rtol=2e-6)
    # activation quantisation costs accuracy against the unquantised product, but within e4m3's half ulp
    exact = x.reshape(6, 80).double() @ expand64(q, s, block).T
    mag = x.reshape(6, 80).double().abs() @ expand64(q, s, block).abs().T
    assert ((out.reshape(6, 48).double() - exact).abs() <= 2**-4 * mag).all()


def fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """torch's block-scaled matmul as one layout convention would have it: activation scales M-major (others
    refused), and the weight's scales read from their storage as a [K/128, N/128] grid, whatever view they come
    in (so the weight's own [N/128, K/128] layout computes wrong values instead of failing)."""
    if scale_a.stride(0) != 1:
        raise RuntimeError("scale_a must be outer-dim major")
    K, N = b.shape
    grid = torch.as_strided(scale_b, (K // 128, N // 128), (N // 128, 1))  # the storage in row-major order
    a64 = a.double() * scale_a.double().repeat_interleave(128, 1)
    b64 = b.double() * grid.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a64 @ b64).to(output_dtype)


@needs_interpreter
def test_cublas_probe_keeps_the_layout_that_reproduces_the_kernel(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm)
    # refused (activation scales as written); wrong values (the weight's scales as stored, and a transposed view
    # of that storage); right (transposed into storage of their own)
    assert fp8._probe_cublas(torch.device("cpu")) == (1, 2)
    q, s = weight(256, 384, (128, 128), seed=3)
    x = torch.randn(300, 384, generator=torch.Generator().manual_seed(4))
    out = fp8.w8a8_linear_cublas(x, q, s, (1, 2))
    check_linear(out, x, q, s, (128, 128), rtol=2e-6)


@needs_interpreter
def test_cublas_probe_falls_back_when_torch_refuses(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(F, "scaled_mm", refuse)
    assert fp8._probe_cublas(torch.device("cpu")) is None
    x, q = torch.empty(260, 512, dtype=torch.bfloat16), torch.empty(384, 512, dtype=fp8.FP8_DTYPE)
    assert fp8._cublas_fits(x, q, (128, 128))
    assert not fp8._cublas_fits(x[:256], q, (128, 128))  # decode and verify sizes: the Triton kernel
    assert not fp8._cublas_fits(x[:257], q, (128, 128))  # the activations' scales' leading dimension unaligned
    assert not fp8._cublas_fits(x.float(), q, (128, 128)) and not fp8._cublas_fits(x, q[:200], (128, 128))
    assert not fp8._cublas_fits(x[:, :384], q[:, :384], (128, 128))  # 3 K blocks: cuBLAS wants a multiple of 4


@needs_interpreter
def test_cublas_refusal_at_run_time_falls_back_to_the_kernel_for_good(monkeypatch):
    calls = []

    def refuse(*args):
        calls.append(args)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(fp8, "use_triton", lambda x: True)  # the GPU dispatch, on CPU tensors (the interpreter)
    monkeypatch.setattr(fp8, "w8a8_linear_cublas", refuse)
    monkeypatch.setitem(fp8._CUBLAS_LAYOUT, -1, (1, 2))
    monkeypatch.setattr(fp8, "cublas_layout", lambda device: fp8._CUBLAS_LAYOUT[-1])
    q, s = weight(128, 512, (128, 128), seed=5)
    x = torch.randn(260, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    check_linear(fp8.w8a8_linear(x, q, s, (128, 128)), x, q, s, (128, 128), rtol=2**-8)
    assert len(calls) == 1 and fp8._CUBLAS_LAYOUT[-1] is None
    check_linear(fp8.w8a8_linear(x, q, s, (128, 128)), x, q, s, (128, 128), rtol=2**-8)
    assert len(calls) == 1  # not asked again


def fp8_experts(E, H, I, block, seed, device="cpu"):
    """Random experts in the model's FP8 layout: gate and up quantised apart (scale rows of their own)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    (qg, sg), (qu, su), (qd, sd) = (quantize_block_fp8(t.to(device), block)
                                    for t in (gate_up[:, :I], gate_up[:, I:], down))
    return torch.cat([qg, qu], 1), torch.cat([sg, su], 1), qd, sd


def experts64(x, gate_up, gu_scale, down, d_scale, weights, experts, block):
    """Per (token, slot) pair in fp64, with the activations quantised where the kernels quantise them: x before
    gate/up, and SiLU(gate) * up (stored in x's dtype) before down."""
    I, half = gate_up.shape[1] // 2, gu_scale.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        xd = act64(x[t : t + 1], block[1])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate = xd @ expand64(gate_up[e, :I], gu_scale[e, :half], block).T
            up = xd @ expand64(gate_up[e, I:], gu_scale[e, half:], block).T
            h = (F.silu(gate) * up).to(x.dtype)
            out[t] += float(weights[t, j]) * (act64(h, block[1]) @ expand64(down[e], d_scale[e], block).T)[0]
    return out


def check_experts(out, want, max_tol, norm_tol):
    err = (out.double() - want).abs()
    assert not out.isnan().any()
    # a value of SiLU(gate) * up near an e4m3 rounding boundary may round the other way in the kernel than in
    # the oracle (always so when the kernel holds it in bf16 and the oracle in fp32): a product term off by an
    # e4m3 ulp, so the bounds are on the output's scale, not per element
    assert err.max() <= max_tol * want.abs().max(), float(err.max() / want.abs().max())
    assert err.norm() <= norm_tol * want.norm(), float(err.norm() / want.norm())


@needs_interpreter
@pytest.mark.parametrize("T,E,top_k", [(1, 8, 2), (5, 8, 4), (37, 16, 2)])
def test_fp8_fused_experts_cpu_interpreter(T, E, top_k):
    H, I, block = 64, 48, (16, 16)  # I = 3 scale blocks: gate and up rows need their own scale rows
    gate_up, gu_scale, down, d_scale = fp8_experts(E, H, I, block, seed=T)
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=g)
    weights, experts = moe.route_torch(x, torch.randn(E, H, generator=g), top_k, renormalize=True)
    want = experts64(x, gate_up, gu_scale, down, d_scale, weights, experts, block)
    kw = dict(gate_up_scale=gu_scale, down_scale=d_scale, block=block)
    buf = torch.full((T * top_k, H), float("nan"))
    got = moe.fused_experts_triton(x, gate_up, down, weights, experts, buf=buf, gate_up_cfg=(32, 16, 4, 1),
                                   down_cfg=(32, 16, 4, 1), **kw)
    assert not buf.isnan().any(), "an element of the per-pair buffer was not written"
    check_experts(got, want, 1e-4, 1e-5)
    check_experts(moe.fused_experts(x, gate_up, down, weights, experts, **kw), want, 1e-4, 1e-5)  # torch path


# ---------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 32, 96, 700])
@pytest.mark.parametrize("N,K", [(12288, 2048), (2048, 4096), (9216, 2048)])
def test_w8a8_gpu(M, N, K):
    block = (128, 128)
    q, s = weight(N, K, block, seed=M + N, device="cuda")
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to("cuda", torch.bfloat16)
    sum_tol = FAST_SUM if M > 32 else FP32_SUM  # 64-row tiles from 33 rows: the fast accumulation
    out = fp8.w8a8_linear(x, q, s, block)
    check_linear(out, x, q, s, block, rtol=2**-8, sum_tol=sum_tol)
    assert torch.equal(fp8.w8a8_linear(x, q, s, block), out)  # split-K: counters reset, partials in fixed order
    layout = fp8.cublas_layout(x.device)
    if M >= fp8.CUBLAS_MIN_ROWS and layout is not None:  # the dispatch took torch's matmul: the kernel too
        check_linear(fp8.w8a8_linear_triton(x, q, s, block), x, q, s, block, rtol=2**-8, sum_tol=sum_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dot,sum_tol", [(0, FAST_SUM), (1, 1e-6)])
def test_w8a8_gpu_summation_error(dot, sum_tol):
    """fp32 output, so no output rounding hides the summation error of each DOT mode (prefill rows)."""
    block = (128, 128)
    q, s = weight(2048, 4096, block, seed=3, device="cuda")
    x = torch.randn(700, 4096, generator=torch.Generator().manual_seed(4)).cuda()
    check_linear(fp8.w8a8_linear_triton(x, q, s, block, dot=dot), x, q, s, block, rtol=0.0, sum_tol=sum_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 96, 600])
def test_fp8_fused_experts_gpu(T):
    """35B-A3B sizes: 256 experts, top 8, H 2048, I 512, bf16 activations, through the dispatch."""
    E, H, I, top_k, block = 256, 2048, 512, 8, (128, 128)
    gate_up, gu_scale, down, d_scale = fp8_experts(E, H, I, block, seed=T, device="cuda")
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    weights, experts = moe.route_torch(x.float(), torch.randn(E, H, generator=g).cuda(), top_k, renormalize=True)
    kw = dict(gate_up_scale=gu_scale, down_scale=d_scale, block=block)
    got = moe.fused_experts(x, gate_up, down, weights.to(torch.bfloat16), experts, **kw)
    # the oracle: the torch reference path in fp32 (its own quantisation of x and of SiLU(gate) * up)
    want = moe._fused_experts_torch(x.float(), gate_up, down, weights, experts, **kw).double()
    check_experts(got, want, 5e-2, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("R,K", [(1, 4096), (96, 2048), (600, 512)])
def test_quantize_activations_gpu(R, K):
    """On the GPU too, the kernel's e4m3 values and scales are `quantize_block_fp8`'s bit for bit (a divisor
    rounded differently moves values across e4m3 rounding boundaries)."""
    x = (torch.randn(R, K, generator=torch.Generator().manual_seed(R)) * 3).to("cuda", torch.bfloat16)
    q, s = fp8.quantize_activations_triton(x, 128)
    want_q, want_s = quantize_block_fp8(x, (1, 128))
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
