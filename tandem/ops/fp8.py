"""Block-scaled FP8 (e4m3) maths and the W8A8 linear layer.

Weights [..., out, in] are stored as e4m3 with one fp32 `scale_inv` per (b0 x b1) block: they read back as
`q.float() * scale_inv` (edge blocks are partial). Activations are quantised the same way on the fly, per token
and per group of b1 input channels (a (1 x b1) block): so in each group of b1 products both operands have one
scale, and a GEMM can multiply in e4m3 and rescale each group's fp32 partial sum by `s_x * s_w`.

`w8a8_linear(x, w, scale_inv, block)` dispatches like every op: CUDA tensors take the Triton kernels, the rest
the torch reference (dequantise both operands after quantising x, then an fp32 matmul). The kernel path is two
launches: `_quantize_groups_kernel` writes x's e4m3 values and per-group scales (IEEE division, so it gives the
reference's values bit for bit), then `_w8a8_kernel` streams the weight through the tensor cores. Where a norm
produced x, its kernel wrote those groups already (`activation_groups`): one launch. Each group's e4m3 product
is rescaled by `s_x * s_w` into an fp32 accumulator. Inside a group, a GEMM of narrow row tiles (decode)
promotes the partial sum to fp32 at every K=32 step (`max_num_imprecise_acc=0`), which is free there; one of
64-row tiles (prefill, verify) keeps Hopper's fast accumulation over the group's 128 products (`dot_mode`).
At decode sizes (few rows) the GEMM is split over K so every SM streams weight; the last program of each tile to
finish (an arrival counter) adds the fp32 partials in split order, so the split costs no extra launch and stays
deterministic. Quantising inside the GEMM instead cost each N tile a re-quantisation of
the whole activation row, which made the GEMM 3-5x slower at decode.

Prefill-size GEMMs (more than 256 rows) are compute-bound, and there the Triton kernel was slower than bf16's
cuBLAS GEMM. They take torch's block-scaled FP8 matmul instead (`F.scaled_mm` with 1x128 activation and 128x128
weight scales: cuBLAS on Hopper) when it is there and reproduces the Triton kernel on this device: the first
such GEMM on a device (never inside a CUDA-graph capture) probes the layouts torch may want the scales in, on a
small problem, and keeps the first one whose result matches (`cublas_layout`); none: the Triton kernel. On an
H100 with torch 2.11 it takes 5.5 ms for a step's dense GEMMs at 2048 rows, the Triton kernel 8.7 and bf16 7.1.
(The probe passes only with K a multiple of 4 blocks and rows a multiple of 4, the shapes `_cublas_fits` admits.)
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F

from tandem.ops.triton_utils import HAS_TRITON, pdl, row_block, use_triton, zeroed_counters

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# amax floor: an all-zero block gets a tiny positive scale (never 0 or inf), and quantises to exact zeros
AMAX_FLOOR = 1e-12
DECODE_MAX_ROWS = 256  # more rows: a compute-bound (prefill) GEMM


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
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, not IEEE-rounded
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
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

    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def quantize_rows(a):
        """An fp32 [M, G] tile (one activation group per row) -> (its e4m3 values, the fp32 scale of each row),
        as `quantize_block_fp8` with a (1, G) block computes them: same floor, same IEEE-rounded divisions."""
        amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        q = tl.math.div_rn(a, tl.broadcast_to(s[:, None], a.shape))
        return tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), s

    @triton.jit
    def store_groups(y, q_ptr, s_ptr, offset, BLOCK: tl.constexpr, G: tl.constexpr):
        """BLOCK consecutive values y of a row-major tensor, from element `offset` (a multiple of G, as BLOCK is),
        as e4m3 groups of G: their values to q_ptr + offset.., their scales to s_ptr + offset // G.. (one kernel
        quantising its own output for an FP8 GEMM, `attach_activation_groups`)."""
        q, s = quantize_rows(tl.reshape(y.to(tl.float32), (BLOCK // G, G)))
        groups = tl.arange(0, BLOCK // G)
        tl.store(q_ptr + offset + groups[:, None] * G + tl.arange(0, G)[None, :], q)
        tl.store(s_ptr + offset // G + groups, s)

    @triton.jit
    def group_dot(q, w, s, ws, DOT: tl.constexpr):
        """One activation group's product rescaled by its scales: (q @ w) * s[:, None] * ws[None, :], fp32.
        DOT 0: e4m3 tensor-core dot (on Hopper's wgmma, Triton's default fast accumulation); 1: the same with
        every K=32 instruction's partial sum promoted to fp32; 2: both operands upcast to bf16 first (exact:
        every e4m3 value is a bf16 value), an fp32-accumulated bf16 dot."""
        if DOT == 2:
            d = tl.dot(q.to(tl.bfloat16), w.to(tl.bfloat16))
        elif DOT == 1:
            d = tl.dot(q, w, max_num_imprecise_acc=0)
        else:
            d = tl.dot(q, w)
        return d * (s[:, None] * ws[None, :])

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, stride_x, K: tl.constexpr, G: tl.constexpr,
                                GB: tl.constexpr, ROWS_ON_DEVICE: tl.constexpr, PDL: tl.constexpr):
        """Row r, groups [pid * GB, pid * GB + GB): e4m3 values into q [R, K], scales into s [R, KB].
        ROWS_ON_DEVICE: rows at or past *rows_ptr are skipped (the MoE's padded pair count, known only there)."""
        wait_for_prior_kernels(PDL)
        r = tl.program_id(0)
        if ROWS_ON_DEVICE:
            if r >= tl.load(rows_ptr):
                return
        KB: tl.constexpr = (K + G - 1) // G
        g = tl.program_id(1) * GB + tl.arange(0, GB)
        cols = g[:, None] * G + tl.arange(0, G)[None, :]
        ok = (g[:, None] < KB) & (cols < K)
        r = r.to(tl.int64)
        a = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        q, sc = quantize_rows(a)
        tl.store(q_ptr + r * K + cols, q, mask=ok)
        tl.store(s_ptr + r * KB + g, sc, mask=g < KB)

    @triton.jit(do_not_specialize=["M"])
    def _w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N: tl.constexpr,
                     K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, KB_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                     PDL: tl.constexpr):
        """out[M, N] = xq[M, K] @ w[N, K]^T, a K step per activation group, each rescaled by its two scales.
        SPLIT > 1: program (m, n, s) takes groups [s * KB_PER_SPLIT, (s + 1) * KB_PER_SPLIT), stores its fp32
        partial in part[s] and counts itself in its tile's counter; the last of the tile's SPLIT programs to
        arrive adds the partials in split order (deterministic) and resets the counter for the next launch."""
        wait_for_prior_kernels(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, GROUP_K)
        m_ok, n_ok = m < M, n < N
        KB: tl.constexpr = (K + GROUP_K - 1) // GROUP_K
        kb0 = pid_s * KB_PER_SPLIT
        x_ptrs = xq_ptr + m[:, None].to(tl.int64) * K + kb0 * GROUP_K + k[None, :]
        w_ptrs = w_ptr + n[None, :].to(tl.int64) * K + kb0 * GROUP_K + k[:, None]  # [GROUP_K, BLOCK_N]
        xs_ptrs = xs_ptr + m.to(tl.int64) * KB + kb0
        ws_ptrs = ws_ptr + (n // GROUP_N) * KB + kb0
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(KB_PER_SPLIT):
            kb = kb0 + i
            k_ok = (kb * GROUP_K + k < K) & (kb < KB)
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            xs = tl.load(xs_ptrs + i, mask=m_ok & (kb < KB), other=0.0)
            ws = tl.load(ws_ptrs + i, mask=n_ok & (kb < KB), other=0.0)
            acc += group_dot(a, w, xs, ws, DOT)
            x_ptrs += GROUP_K
            w_ptrs += GROUP_K
        ok = m_ok[:, None] & n_ok[None, :]
        mn = m[:, None].to(tl.int64) * N + n[None, :]
        if SPLIT > 1:
            tl.store(part_ptr + pid_s.to(tl.int64) * M * N + mn, acc, mask=ok)
            tile = pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:  # the others' partials are out
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(part_ptr + s * M * N + mn, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + mn, acc.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(count_ptr + tile, 0)
        else:
            tl.store(out_ptr + mn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_activations(x: torch.Tensor, group: int):
    """x [R, K] -> (e4m3 [R, K], fp32 scales [R, ceil(K / group)]): `quantize_block_fp8(x, (1, group))`, which
    CUDA tensors get from one Triton launch."""
    if use_triton(x):
        return quantize_activations_triton(x, group)
    return quantize_block_fp8(x, (1, group))


def quantize_activations_triton(x, group, rows=None):
    """The kernel path; `rows` (a one-element int32 device tensor): rows at or past it are left unwritten."""
    R, K = x.shape
    kb = cdiv(K, group)
    q = torch.empty(R, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(R, kb, dtype=torch.float32, device=x.device)
    if R:
        gb = min(triton.next_power_of_2(kb), max(1, 4096 // group))  # a [GB, group] tile of up to 4K values
        x = x if x.stride(-1) == 1 else x.contiguous()
        _quantize_groups_kernel[(R, triton.cdiv(kb, gb))](x, q, s, s if rows is None else rows, x.stride(0), K=K,
                                                          G=group, GB=gb, ROWS_ON_DEVICE=rows is not None, **pdl(x))
    return q, s


# ------------------------------------------------------------- activation groups written by their producer

# A kernel whose output an FP8 GEMM reads (the norms) may write that output's e4m3 groups in the same pass. It
# hangs them on the output tensor it returns, and the GEMMs handed that very tensor take them instead of
# quantising it again; any other tensor (a view or copy of it included) is quantised by its reader. The output
# must not be written in place afterwards: nothing is, as every norm output is a fresh tensor.
_GROUPS_ATTR = "_fp8_activation_groups"


def group_buffers(out: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised buffers for a kernel that also writes `out`'s e4m3 groups of `group` consecutive values:
    the values in out's layout, and one fp32 scale per group in memory order. group 0 (the kernel writes no
    groups): `out` twice, pointers the kernel never stores through."""
    if not group:
        return out, out
    return (torch.empty(out.shape, dtype=FP8_DTYPE, device=out.device),
            torch.empty(out.numel() // group, dtype=torch.float32, device=out.device))


def attach_activation_groups(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] (contiguous) with its groups as `group_buffers` holds them, once written, hung on it as its
    readers take them (rows of K); returns x. Nothing is hung for group 0 (no groups written) or for rows that
    are not whole groups (they can feed no GEMM)."""
    K = x.shape[-1]
    if group and K % group == 0:
        setattr(x, _GROUPS_ATTR, (group, q.view(-1, K), s.view(-1, K // group)))
    return x


def activation_groups(x: torch.Tensor, group: int):
    """x [..., K] -> (e4m3 [R, K], fp32 scales [R, K / group]) as `quantize_activations_triton` gives them: those
    its producer wrote when it did (`attach_activation_groups`), else from one launch of the group quantiser."""
    written = getattr(x, _GROUPS_ATTR, None)
    if written is not None and written[0] == group:
        return written[1], written[2]
    return quantize_activations_triton(x.reshape(-1, x.shape[-1]), group)


def w8a8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) by an e4m3 weight w [N, K] with block scales -> [..., N] in x's dtype."""
    if use_triton(x):
        if _cublas_fits(x, w, block) and (layout := cublas_layout(x.device)) is not None:
            try:
                return w8a8_linear_cublas(x, w, scale_inv, layout)
            except RuntimeError as e:  # a shape the probe's did not foretell (cuBLAS's refusal is host-side)
                log.warning("FP8 prefill GEMMs: the Triton kernel from now on (torch's block-scaled matmul "
                            "refused x %s, w %s: %s)", tuple(x.shape), tuple(w.shape), str(e).splitlines()[0][:100])
                _CUBLAS_LAYOUT[_device_index(x.device)] = None
        return w8a8_linear_triton(x, w, scale_inv, block)
    return w8a8_linear_torch(x, w, scale_inv, block)


# ------------------------------------------------------------------------------ torch's block-scaled FP8 matmul

CUBLAS_MIN_ROWS = DECODE_MAX_ROWS + 1  # up to there (decode, verify) the Triton kernel streams the weight
# the layouts the scales may have to be in: activations' [M, K/128] as written or M-major; the weight's
# [N/128, K/128] as stored, transposed, or transposed and contiguous (each the same storage: always in bounds)
_A_LAYOUTS = (lambda s: s, lambda s: s.t().contiguous().t())
_B_LAYOUTS = (lambda s: s, lambda s: s.t(), lambda s: s.t().contiguous())
_CUBLAS_LAYOUT: dict[int, tuple[int, int] | None] = {}


def _cublas_fits(x, w, block) -> bool:
    """cuBLAS reads the weight's scale grid with its K extent padded to a multiple of 4 blocks (the model's K of
    2048 and 4096 need none), and torch wants the activations' scales M-major with a leading dimension of exactly
    M, which cuBLAS needs 16-byte aligned (M a multiple of 4: on an H100 a probe of 301 rows got
    CUBLAS_STATUS_NOT_SUPPORTED in the one layout torch accepted, one of 300 rows passes). Other shapes take the
    Triton kernel rather than a padded copy per call; the engine's warm-up reaches both."""
    N, K = w.shape
    rows = x.numel() // K if K else 0
    return (rows >= CUBLAS_MIN_ROWS and rows % 4 == 0 and tuple(block) == (128, 128) and N % 128 == 0
            and K % 512 == 0 and x.dtype in (torch.bfloat16, torch.float16))


def _recipes():
    """torch's (1x128, 128x128) scaling recipes, or None when this torch has no `F.scaled_mm`."""
    kinds = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or kinds is None:
        return None
    names = {n.lower().replace("_", ""): n for n in dir(kinds)}  # spelled BlockWise1x128 or Blockwise_1x128
    if "blockwise1x128" not in names or "blockwise128x128" not in names:
        return None
    return getattr(kinds, names["blockwise1x128"]), getattr(kinds, names["blockwise128x128"])


def _scaled_mm(xq, xs, w, scale_inv, layout, out_dtype):
    rows, blocks = _recipes()
    return F.scaled_mm(xq, w.t(), _A_LAYOUTS[layout[0]](xs), rows, _B_LAYOUTS[layout[1]](scale_inv), blocks,
                       output_dtype=out_dtype)


def w8a8_linear_cublas(x, w, scale_inv, layout):
    """x's e4m3 groups (its producer's, or the group quantiser's), then torch's block-scaled matmul with the
    scales in `layout`."""
    N, K = w.shape
    xq, xs = activation_groups(x, 128)
    return _scaled_mm(xq, xs, w, scale_inv, layout, x.dtype).view(*x.shape[:-1], N)


def cublas_layout(device: torch.device) -> tuple[int, int] | None:
    """The scale layouts under which torch's block-scaled matmul reproduces the Triton kernel on this device
    (probed once per device, outside graph captures), or None: the Triton kernel (always off CUDA: the kernels'
    compile-only checks run them on CPU tensors)."""
    if device.type != "cuda":
        return None
    index = _device_index(device)
    if index not in _CUBLAS_LAYOUT:
        if torch.cuda.is_current_stream_capturing():
            return None  # probe later, outside the capture
        _CUBLAS_LAYOUT[index] = _probe_cublas(torch.device(device.type, index))
    return _CUBLAS_LAYOUT[index]


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":  # the kernels on CPU tensors (the interpreter tests): one key for them
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def _probe_cublas(device: torch.device) -> tuple[int, int] | None:
    """Each layout on a 300 x 512 by 256 x 512 problem (rows not a multiple of the 128-row tile, but of the 4 that
    cuBLAS needs, `_cublas_fits`; non-square scale grids, so a transposed one shows; K of 4 blocks, which cuBLAS
    needs unpadded), against the Triton kernel, within 2^-8 of the magnitudes |x| @ |w|."""
    if _recipes() is None:
        log.info("FP8 prefill GEMMs: the Triton kernel (this torch has no block-scaled F.scaled_mm)")
        return None
    g = torch.Generator(device=device).manual_seed(0)
    # every scale block of a different magnitude, so a scale read from the wrong block shows
    groups = torch.arange(1, 5, device=device, dtype=torch.float32).repeat_interleave(128)  # [512]
    rows = torch.linspace(0.5, 2.0, 300, device=device)[:, None]
    x = (torch.randn(300, 512, device=device, generator=g) * groups * rows).to(torch.bfloat16)
    blocks = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 7.0, 11.0, 13.0]], device=device)  # [N/128, K/128]
    w_full = torch.randn(256, 512, device=device, generator=g) / 512**0.5
    w, s = quantize_block_fp8(w_full * blocks.repeat_interleave(128, 0).repeat_interleave(128, 1))
    want = w8a8_linear_triton(x, w, s, (128, 128)).float()
    bound = 2**-8 * (x.float().abs() @ dequantize_block_fp8(w, s).float().abs().T) + 1e-6
    xq, xs = quantize_activations_triton(x, 128)
    refused = []
    for layout in itertools.product(range(len(_A_LAYOUTS)), range(len(_B_LAYOUTS))):
        try:
            got = _scaled_mm(xq, xs, w, s, layout, torch.bfloat16).float()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            refused.append(str(e).splitlines()[0][:100] if str(e) else type(e).__name__)
            continue
        if got.shape == want.shape and ((got - want).abs() <= bound).all():
            log.info("FP8 prefill GEMMs: torch's block-scaled matmul (scale layouts %s)", layout)
            return layout
    log.info("FP8 prefill GEMMs: the Triton kernel (no scale layout reproduced it; refusals: %s)",
             sorted(set(refused)))
    return None


def w8a8_linear_torch(x, w, scale_inv, block):
    group = (1, block[1])
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize_block_fp8(*quantize_block_fp8(x2, group), group)
    out = xd @ dequantize_block_fp8(w, scale_inv, block).T
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


_SM_COUNT: dict[int, int] = {}


def dot_mode(block_m: int) -> int:
    """`group_dot`'s DOT for a GEMM whose row tile is `block_m`. Tiles of 64 rows and more (prefill, and dense
    verify GEMMs past 32 rows) take Hopper's fast e4m3 accumulation within each 128-wide group, promoted to fp32
    once a group as DeepSeek's and vLLM's block-FP8 GEMMs do; summation error at most 3.2e-5 of |x| @ |w|, below
    a bf16 output's rounding. It is 2.2x faster for the dense GEMMs and 1.5x for the experts at 2048 rows, and
    1.2-1.6x for the dense ones at 96 rows (an H100), where promoting every K = 32 step of a 64-row tile costs as
    much as streaming the weight. Narrower tiles (decode) promote every K = 32 step, which costs them nothing."""
    return 0 if block_m >= 64 else 1


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: one "SM"
        return 1
    index = _device_index(device)
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _gemm_tiles(M: int, N: int, KB: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, K splits, warps, stages). Few rows (decode): the GEMM streams the weight, so N tiles
    are narrowed, then K split, until there are about two programs per SM; many rows: large tiles for the
    tensor cores."""
    if M > DECODE_MAX_ROWS:
        return 64, 128, 1, 4, 3
    bm = row_block(M)
    bn, split = 128, 1
    while bn > 32 and cdiv(M, bm) * cdiv(N, bn) < 2 * sms:
        bn //= 2
    while split < KB and cdiv(M, bm) * cdiv(N, bn) * split < 2 * sms:
        split *= 2
    return bm, bn, min(split, KB), 4, 4


def w8a8_linear_triton(x, w, scale_inv, block, *, tiles=None, dot=None):
    """The kernel path: x's e4m3 groups (its producer's, or one launch of the quantiser), then the GEMM (split
    over K when `tiles` or the choice says so). `tiles` = (BLOCK_M, BLOCK_N, K splits, warps, stages) overrides
    the choice (tests). (Each GEMM program quantising its own rows' groups instead, with the quantiser's IEEE
    divisions, was 3-5x slower at decode (`afc28a4`), and again since (`7d0cd0d`, undone): every N tile redoes
    them.)"""
    N, K = w.shape
    if x.shape[-1] != K or tuple(scale_inv.shape) != scale_shape(w.shape, block):
        raise ValueError(f"w8a8_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, scale_inv "
                         f"{tuple(scale_inv.shape)} with blocks {tuple(block)} do not agree")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if not M:
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    kb = cdiv(K, block[1])
    bm, bn, split, warps, stages = tiles or _gemm_tiles(M, N, kb, _sm_count(x.device))
    dot = dot_mode(bm) if dot is None else dot
    per_split = cdiv(kb, split)
    split = cdiv(kb, per_split)
    xq, xs = activation_groups(x, block[1])
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    part, counts = (torch.empty(split, M, N, dtype=torch.float32, device=x.device),
                    # `_gemm_tiles` splits only grids of fewer than two programs per SM: 4096 counters serve
                    zeroed_counters("split-K tiles", x.device, grid[0] * grid[1], 4096)) if split > 1 else (out, out)
    _w8a8_kernel[grid](xq, xs, w, scale_inv, out, part, counts, M, N=N, K=K, GROUP_N=block[0], GROUP_K=block[1],
                       BLOCK_M=bm, BLOCK_N=bn, KB_PER_SPLIT=per_split, SPLIT=split, DOT=dot, num_warps=warps,
                       num_stages=stages, **pdl(xq))
    return out.view(*x.shape[:-1], N)
