"""Unquantised projections with few output rows at decode sizes: `linear(x, w) = x @ w^T`.

The MoE block's router | shared-expert gate (257 outputs in the 35B-A3B) and, in an FP8 model, GDN's b | a (64)
are 1 MB and 0.25 MB GEMMs. At verify sizes (96 rows) cuBLAS runs the router | gate split-K with a reduce
launch, 10.5 µs on the H200. From SKINNY_MIN_ROWS to SKINNY_MAX_ROWS rows and up to SKINNY_MAX_N outputs
`skinny_linear_triton` takes them instead, 6.2 µs there: one program per (BLOCK_N outputs, BLOCK_M rows) streams its
outputs' weight rows over K once, with no split and no second launch (deterministic). At 1, 3 and 32 rows cuBLAS's
GEMV-like kernels were faster (5.3-5.4 µs against 6.0-6.5: 17 programs of 16 outputs are too few to stream 1 MB).
Everything else -- or not on CUDA -- is `F.linear` (the reference).
"""

import torch
import torch.nn.functional as F

from tandem.ops.triton_utils import HAS_TRITON, pdl, row_block, use_triton

SKINNY_MIN_ROWS = 33  # the H200 profiles of 2026-12-05: cuBLAS up to 32 rows, this kernel at 96
SKINNY_MAX_ROWS = 128  # verify steps; prefill rows go to cuBLAS
SKINNY_MAX_N = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit(do_not_specialize=["M"])
    def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_x, stride_w, stride_o, K: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_kernels(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :]
        w_ptrs = w_ptr + n[None, :].to(tl.int64) * stride_w + k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + k < K
            a = tl.load(x_ptrs, mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & (n < N)[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(m < M)[:, None] & (n < N)[None, :])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] in x's dtype."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if use_triton(x) and SKINNY_MIN_ROWS <= rows <= SKINNY_MAX_ROWS and w.shape[0] <= SKINNY_MAX_N:
        return skinny_linear_triton(x, w)
    return F.linear(x, w)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, tiles=None) -> torch.Tensor:
    """The kernel; `tiles` = (BLOCK_N, BLOCK_K, warps, stages) overrides the default (16, 128, 4, 4) (benchmarks)."""
    K = x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K and w.stride(1) == 1
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = row_block(M)
    block_n, block_k, warps, stages = tiles or (16, 128, 4, 4)  # many programs: each streams 16 weight rows
    _skinny_linear_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x2, w, out, M, N, x2.stride(0), w.stride(0), out.stride(0), K=K, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages, **pdl(x))
    return out.view(*x.shape[:-1], N)
