"""Block-scaled FP8 (e4m3) maths and the W8A8 linear layer.

Weights [..., out, in] are stored as e4m3 with one fp32 `scale_inv` per (b0 x b1) block: they read back as
`q.float() * scale_inv` (edge blocks are partial). Activations are quantised the same way on the fly, per token
and per group of b1 input channels (a (1 x b1) block): so in each group of b1 products both operands have one
scale, and a GEMM can multiply in e4m3 and rescale each group's fp32 partial sum by `s_x * s_w`.

`w8a8_linear(x, w, scale_inv, block)` dispatches like every op: CUDA tensors take the Triton kernel, the rest the
torch reference (dequantise both operands after quantising x, then an fp32 matmul). The kernel quantises x inside
the GEMM (one launch, no activation round trip through memory): each program loads a [BLOCK_M, b1] tile of x,
takes each row's amax, divides with IEEE rounding (so it gives the reference's e4m3 values exactly) and feeds the
e4m3 tile to the tensor cores. Each group's partial product goes to an fp32 accumulator of its own before the
rescale, which also sidesteps Hopper's reduced-precision accumulation of long e4m3 dot products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.ops.triton_utils import HAS_TRITON, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# amax floor: an all-zero block gets a tiny positive scale (never 0 or inf), and quantises to exact zeros
AMAX_FLOOR = 1e-12


class Fp8FormatError(ValueError):
    """An FP8 tensor or quantization_config this code cannot read (the loader re-raises it as CheckpointError)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape, block=(128, 128)) -> tuple[int, ...]:
    """The `scale_inv` shape of a weight of `shape` ([..., out, in])."""
    *lead, m, n = shape
    return (*lead, cdiv(m, block[0]), cdiv(n, block[1]))


@torch.no_grad()
def quantize_block_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (e4m3 weight of w's shape, fp32 scale_inv [..., ceil(out/b0), ceil(in/b1)]).
    Per block: scale_inv = amax / 448 (amax floored at 1e-12, so a zero block is exact zeros with a finite
    scale), q = round_to_e4m3(w / scale_inv), saturated at +-448."""
    if w.ndim < 2:
        raise ValueError(f"block quantisation needs a [..., out, in] tensor, got shape {tuple(w.shape)}")
    bm, bn = block
    *lead, m, n = w.shape
    mb, nb = cdiv(m, bm), cdiv(n, bn)
    x = F.pad(w.float(), (0, nb * bn - n, 0, mb * bm - m)).view(*lead, mb, bm, nb, bn)
    amax = x.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)  # [..., mb, nb]
    scale_inv = amax / FP8_MAX
    q = (x / scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, mb * bm, nb * bn)[..., :m, :n].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`w_fp8.float() * scale_inv` with each scale broadcast over its block, in `dtype` (the product is fp32)."""
    expected = scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise Fp8FormatError(f"scale_inv of shape {tuple(scale_inv.shape)} for a weight of shape "
                             f"{tuple(w_fp8.shape)} with blocks {tuple(block)}: expected {expected}")
    m, n = w_fp8.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :m, :n]
    return (w_fp8.float() * s).to(dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows(a):
        """An fp32 [M, G] tile (one activation group per row) -> (its e4m3 values, the fp32 scale of each row),
        as `quantize_block_fp8` with a (1, G) block computes them: same floor, same IEEE-rounded divisions."""
        amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        q = tl.math.div_rn(a, tl.broadcast_to(s[:, None], a.shape))
        return tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), s

    @triton.jit
    def _w8a8_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, stride_xm, stride_om, N: tl.constexpr, K: tl.constexpr,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """out[M, N] = quant(x)[M, K] @ w[N, K]^T, a K step per activation group (BLOCK_K = GROUP_K)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, GROUP_K)
        m_ok, n_ok = m < M, n < N
        KB: tl.constexpr = (K + GROUP_K - 1) // GROUP_K
        x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :]
        w_ptrs = w_ptr + n[None, :].to(tl.int64) * K + k[:, None]  # [GROUP_K, BLOCK_N]
        ws_ptrs = ws_ptr + (n // GROUP_N) * KB
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(KB):
            k_ok = kb * GROUP_K + k < K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            ws = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
            q, s = quantize_rows(a)
            acc += tl.dot(q, w) * (s[:, None] * ws[None, :])
            x_ptrs += GROUP_K
            w_ptrs += GROUP_K
        out_ptrs = out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) by an e4m3 weight w [N, K] with block scales -> [..., N] in x's dtype."""
    if use_triton(x):
        return w8a8_linear_triton(x, w, scale_inv, block)
    return w8a8_linear_torch(x, w, scale_inv, block)


def w8a8_linear_torch(x, w, scale_inv, block):
    group = (1, block[1])
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize_block_fp8(*quantize_block_fp8(x2, group), group)
    out = xd @ dequantize_block_fp8(w, scale_inv, block).T
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _gemm_tiles(M: int, N: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages). Few rows (decode): the GEMM streams the weight, so N tiles are narrowed
    until there are about two programs per SM; many rows: large tiles for the tensor cores."""
    if M > 64:
        return 128, 128, 8, 3
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 128
    while bn > 32 and cdiv(M, bm) * cdiv(N, bn) < 2 * sms:
        bn //= 2
    return bm, bn, 4, 4


def w8a8_linear_triton(x, w, scale_inv, block, *, tiles=None):
    """The kernel path; `tiles` = (BLOCK_M, BLOCK_N, warps, stages) overrides the choice (tests)."""
    N, K = w.shape
    if x.shape[-1] != K or tuple(scale_inv.shape) != scale_shape(w.shape, block):
        raise ValueError(f"w8a8_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, scale_inv "
                         f"{tuple(scale_inv.shape)} with blocks {tuple(block)} do not agree")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        bm, bn, warps, stages = tiles or _gemm_tiles(M, N, _sm_count(x.device) if x.is_cuda else 1)
        _w8a8_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2, w, scale_inv, out, M, x2.stride(0), out.stride(0), N=N, K=K, GROUP_N=block[0], GROUP_K=block[1],
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], N)
