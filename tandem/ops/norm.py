"""RMS norms of Qwen3.5: a torch reference and a Triton kernel for each, behind one dispatch.

- `rms_norm_1p`: zero-centred weight, `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32.
- `add_rms_norm_1p`: the residual add before it, `h = h + delta` (rounded to the model dtype), and the norm of that
  h, in one pass; `delta` may also come as parts [T, P, H] (a MoE block's per-expert outputs, `fused_experts`
  with `summed=False`), summed in order in fp32 and rounded once, as `sum(1)` would, in the same pass.
- `gated_rms_norm`: the GDN output norm, plain weight, applied per value head before the gate:
  `w * rms(o) * silu(z)`.
"""

import torch
import torch.nn.functional as F

from tandem.ops.triton_utils import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_1p_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (x * inv * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_1p_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr,
                                PARTS: tl.constexpr):
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
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (x * inv * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n_rows"])
    def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, n_cols, heads, stride_zt, stride_zh, eps,
                               BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """ROWS rows of x (contiguous [n_rows, n_cols]) per program; row r's gate is z[r // heads, r % heads], read
        in place from the projection output it is a view of."""
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
        tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (scaled * z * tl.sigmoid(z)).to(dt), mask=mask)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_1p_triton(x, weight, eps) if use_triton(x) else rms_norm_1p_torch(x, weight, eps)


def add_rms_norm_1p(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """h [T, H], delta [T, H] or parts [T, P, H] -> (h + delta, rms_norm_1p(h + delta)) (parts: h + delta.sum(1))."""
    if use_triton(h):
        return add_rms_norm_1p_triton(h, delta, weight, eps)
    return add_rms_norm_1p_torch(h, delta, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return gated_rms_norm_triton(x, z, weight, eps) if use_triton(x) else gated_rms_norm_torch(x, z, weight, eps)


def rms_norm_1p_torch(x, weight, eps):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_1p_torch(h, delta, weight, eps):
    h = h + (delta if delta.dim() == h.dim() else delta.sum(-2))
    return h, rms_norm_1p_torch(h, weight, eps)


def gated_rms_norm_torch(x, z, weight, eps):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # weight multiplies in the model dtype, the gate in fp32 (as the reference implementation does)
    return ((weight * normed) * F.silu(z.float())).to(x.dtype)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return x2, torch.empty_like(x2), triton.next_power_of_2(x.shape[-1])


def rms_norm_1p_triton(x, weight, eps):
    x2, out, block = _rows(x)
    _rms_norm_1p_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], eps, BLOCK=block)
    return out.view(x.shape)


def gated_rms_norm_triton(x, z, weight, eps):
    """x, z: [T, heads, n] (or [R, n]); z may be strided over its first two dims (a view of a fused projection)."""
    x2, out, block = _rows(x)
    z3 = z if z.dim() == 3 else z.reshape(-1, 1, z.shape[-1])
    if z3.stride(2) != 1:
        z3 = z3.contiguous()
    rows = max(1, min(32, 4096 // block))  # several rows a program: a row of a GDN head is only 128 values
    _gated_rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
        x2, z3, weight, out, x2.shape[0], x2.shape[1], z3.shape[1], z3.stride(0), z3.stride(1), eps,
        BLOCK=block, ROWS=rows)
    return out.view(x.shape)


def add_rms_norm_1p_triton(h, delta, weight, eps):
    h2, out, block = _rows(h)
    total = torch.empty_like(h2)
    parts = 1 if delta.dim() == h.dim() else delta.shape[-2]
    _add_rms_norm_1p_kernel[(h2.shape[0],)](h2, delta.contiguous(), weight, total, out, h2.shape[1], eps,
                                            BLOCK=block, PARTS=parts)
    return total.view(h.shape), out.view(h.shape)
