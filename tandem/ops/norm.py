"""RMS norms of Qwen3.5: a torch reference and a Triton kernel for each, behind one dispatch.

- `rms_norm_1p`: zero-centred weight, `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32.
- `add_rms_norm_1p`: the residual add before it, `h = h + delta` (rounded to the model dtype), and the norm of that
  h, in one pass; `delta` may also come as parts [T, P, H] (a MoE block's per-expert outputs, `fused_experts`
  with `summed=False`), summed in order in fp32 and rounded once, as `sum(1)` would, in the same pass.
- `gated_rms_norm`: the GDN output norm, plain weight, applied per value head before the gate:
  `w * rms(o) * silu(z)` (heads as a dimension of their own, or side by side in the last one).

Each takes `group`: when its output feeds FP8 GEMMs with activation groups of that size, the kernel also writes
the output's e4m3 groups and their scales (exactly as the group quantiser would from the stored output) in the
same pass, and hangs them on the output (`tandem.ops.fp8.attach_activation_groups`): one launch and one read of
the activations fewer for each FP8 GEMM input. The references ignore it (their consumers quantise).
"""

import torch
import torch.nn.functional as F

from tandem.ops.fp8 import attach_activation_groups, group_buffers
from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.triton_utils import wait_for_prior_kernels

    from tandem.ops.fp8 import quantize_rows, store_groups

    @triton.jit
    def _store_norm_1p(x, w_ptr, out_ptr, q_ptr, s_ptr, row, n_cols, eps, BLOCK: tl.constexpr, G: tl.constexpr):
        """Row `row`'s norm (x: its fp32 values, zero past n_cols) stored to out, and with G > 0 its e4m3 groups
        of G (then n_cols == BLOCK)."""
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * inv * (1.0 + w)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)
        if G > 0:
            store_groups(y, q_ptr, s_ptr, row * BLOCK, BLOCK, G)

    @triton.jit
    def _rms_norm_1p_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, n_cols, eps, BLOCK: tl.constexpr, G: tl.constexpr,
                            PDL: tl.constexpr):
        """G > 0: also the output's e4m3 groups of G (then n_cols == BLOCK)."""
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        _store_norm_1p(x, w_ptr, out_ptr, q_ptr, s_ptr, row, n_cols, eps, BLOCK, G)

    @triton.jit
    def _add_rms_norm_1p_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, s_ptr, n_cols, eps,
                                BLOCK: tl.constexpr, PARTS: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(PARTS):
            d += tl.load(d_ptr + (row * PARTS + p) * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if PARTS > 1:  # the parts' sum in the model dtype, as delta.sum(1) gives it
            d = d.to(sum_ptr.dtype.element_ty).to(tl.float32)
        x = (h + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
        _store_norm_1p(x.to(tl.float32), w_ptr, out_ptr, q_ptr, s_ptr, row, n_cols, eps, BLOCK, G)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, q_ptr, s_ptr, n_rows, n_cols, heads, stride_zt,
                               stride_zh, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr,
                               PDL: tl.constexpr):
        """ROWS rows of x (contiguous [n_rows, n_cols]) per program; row r's gate is z[r // heads, r % heads], read
        in place from the projection output it is a view of. G > 0: also the output's e4m3 groups of G values in
        memory order (n_cols == BLOCK, and a program's ROWS * BLOCK values are whole groups)."""
        wait_for_prior_kernels(PDL)
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z_rows = (rows // heads) * stride_zt + (rows % heads) * stride_zh
        z = tl.load(z_ptr + z_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
        dt = out_ptr.dtype.element_ty
        # round where the reference rounds: the normed value and its product with w live in the model dtype
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]).to(dt)
        scaled = (normed * w.to(dt)[None, :]).to(tl.float32)
        y = (scaled * z * tl.sigmoid(z)).to(dt)
        tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y, mask=mask)
        if G > 0:  # a group never straddles two programs, so masked rows make whole masked groups
            q, s = quantize_rows(tl.reshape(y.to(tl.float32), (ROWS * BLOCK // G, G)))
            tl.store(q_ptr + rows[:, None] * n_cols + cols[None, :], tl.reshape(q, (ROWS, BLOCK)), mask=mask)
            g = tl.program_id(0) * (ROWS * BLOCK // G) + tl.arange(0, ROWS * BLOCK // G)
            tl.store(s_ptr + g, s, mask=g < n_rows * BLOCK // G)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    return rms_norm_1p_triton(x, weight, eps, group) if use_triton(x) else rms_norm_1p_torch(x, weight, eps)


def add_rms_norm_1p(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                    group: int | None = None):
    """h [T, H], delta [T, H] or parts [T, P, H] -> (h + delta, rms_norm_1p(h + delta)) (parts: h + delta.sum(1))."""
    if use_triton(h):
        return add_rms_norm_1p_triton(h, delta, weight, eps, group)
    return add_rms_norm_1p_torch(h, delta, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   group: int | None = None) -> torch.Tensor:
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps, group)
    return gated_rms_norm_torch(x, z, weight, eps)


def rms_norm_1p_torch(x, weight, eps):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_1p_torch(h, delta, weight, eps):
    h = h + (delta if delta.dim() == h.dim() else delta.sum(-2))
    return h, rms_norm_1p_torch(h, weight, eps)


def gated_rms_norm_torch(x, z, weight, eps):
    n = weight.shape[0]
    xf, zf = x.float().unflatten(-1, (-1, n)), z.float().unflatten(-1, (-1, n))  # [T, heads * n]: per head
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # weight multiplies in the model dtype, the gate in fp32 (as the reference implementation does)
    return ((weight * normed) * F.silu(zf)).to(x.dtype).view(x.shape)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return x2, torch.empty_like(x2), triton.next_power_of_2(x.shape[-1])


def _row_groups(out, group, block) -> int:
    """`group`, when a kernel writing whole rows of `out` [R, n] (n == block) can write them as e4m3 groups of
    `group` too, else 0."""
    n = out.shape[1]
    return group if group and n == block and n % group == 0 and not group & (group - 1) else 0


def rms_norm_1p_triton(x, weight, eps, group=None):
    x2, out, block = _rows(x)
    g = _row_groups(out, group, block)
    q, s = group_buffers(out, g)
    _rms_norm_1p_kernel[(x2.shape[0],)](x2, weight, out, q, s, x2.shape[1], eps, BLOCK=block, G=g, **pdl(x2))
    return attach_activation_groups(out.view(x.shape), q, s, g)


def gated_rms_norm_triton(x, z, weight, eps, group=None):
    """x, z: [T, heads, n] or [T, heads * n] (or [R, n]), n = len(weight): each head's n values normed and gated;
    z may be strided over its leading dims (a view of a fused projection). `group`: the output's e4m3 groups too
    (as rows of its last dimension), when a token's values are whole groups."""
    n = weight.shape[0]
    x2, out, block = _rows(x.reshape(-1, n))
    if x.shape[-1] != n:  # [T, heads * n]
        z3 = z.view(z.shape[0], -1, n)
    else:
        z3 = z if z.dim() == 3 else z.reshape(-1, 1, n)
    if z3.stride(2) != 1:
        z3 = z3.contiguous()
    rows = max(1, min(32, 4096 // block))  # several rows a program: a row of a GDN head is only 128 values
    g = group if group and n == block and not group & (group - 1) and (rows * n) % group == 0 \
        and (z3.shape[1] * n) % group == 0 else 0  # whole groups a program, none across two tokens
    q, s = group_buffers(out, g)
    _gated_rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
        x2, z3, weight, out, q, s, x2.shape[0], x2.shape[1], z3.shape[1], z3.stride(0), z3.stride(1), eps,
        BLOCK=block, ROWS=rows, G=g, **pdl(x2))
    return attach_activation_groups(out.view(x.shape), q, s, g)


def add_rms_norm_1p_triton(h, delta, weight, eps, group=None):
    h2, out, block = _rows(h)
    total = torch.empty_like(h2)
    parts = 1 if delta.dim() == h.dim() else delta.shape[-2]
    g = _row_groups(out, group, block)
    q, s = group_buffers(out, g)
    _add_rms_norm_1p_kernel[(h2.shape[0],)](h2, delta.contiguous(), weight, total, out, q, s, h2.shape[1], eps,
                                            BLOCK=block, PARTS=parts, G=g, **pdl(h2))
    return total.view(h.shape), attach_activation_groups(out.view(h.shape), q, s, g)
