"""Pointwise epilogues fused into one launch each (a decode step at small batch is bound by the number of kernels,
not by their bytes): a torch reference and a Triton kernel for each, behind one dispatch.

- `silu_mul(gate, up)`: the SwiGLU activation `silu(gate) * up`.
- `sigmoid_gate(x, gate)`: gated attention's output gate `x * sigmoid(gate)`, gate [T, heads, head_dim] read
  where the fused q | gate projection left it (no copy).
- `gdn_gates(a, b, A_log, dt_bias)`: Gated DeltaNet's per-head gates, `beta = sigmoid(b)` and the fp32 log-decay
  `g = -exp(A_log) * softplus(a + dt_bias)`.
- `gated_sum(parts, shared, logit)`: the MoE block's output `sum_k parts[:, k] + sigmoid(logit) * shared`, the
  routed experts' per-slot outputs added in slot order (deterministic) plus the sigmoid-gated shared expert.

The SwiGLU and the output gate take `group` as the norms do (`tandem.ops.norm`): they then also write their
output's e4m3 groups for the FP8 GEMM that reads it.

The kernels round where the references round (to the model dtype after each torch op), so both paths give the
same values up to fp32 summation order.
"""

import torch
import torch.nn.functional as F

from tandem.ops.fp8 import attach_activation_groups, group_buffers
from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.fp8 import store_groups
    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, q_ptr, s_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr,
                         G: tl.constexpr, PDL: tl.constexpr):
        """G > 0: also the output's e4m3 groups of G (then BLOCK divides n_cols)."""
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0)
        dt = out_ptr.dtype.element_ty
        act = (g * tl.sigmoid(g)).to(dt)
        y = (act.to(tl.float32) * u.to(tl.float32)).to(dt)
        tl.store(out_ptr + row * n_cols + cols, y, mask=ok)
        if G > 0:
            store_groups(y, q_ptr, s_ptr, row * n_cols + tl.program_id(1) * BLOCK, BLOCK, G)

    @triton.jit
    def _sigmoid_gate_kernel(x_ptr, gate_ptr, out_ptr, q_ptr, s_ptr, n_cols, stride_gt, stride_gh, HD: tl.constexpr,
                             BLOCK: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
        """G > 0: also the output's e4m3 groups of G (then BLOCK divides n_cols)."""
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + row * stride_gt + (cols // HD) * stride_gh + cols % HD, mask=ok, other=0.0)
        dt = out_ptr.dtype.element_ty
        sig = tl.sigmoid(gate.to(tl.float32)).to(dt).to(tl.float32)
        y = (x * sig).to(dt)
        tl.store(out_ptr + row * n_cols + cols, y, mask=ok)
        if G > 0:
            store_groups(y, q_ptr, s_ptr, row * n_cols + tl.program_id(1) * BLOCK, BLOCK, G)

    @triton.jit
    def gdn_gate_values(a, b, a_log, dt_bias):
        """fp32 (g, sigmoid(b)) from fp32 a, b and the head's A_log, dt_bias; the caller rounds beta to b's dtype,
        as the reference does. Also used inside the GDN recurrent kernel (`tandem/ops/gdn.py`)."""
        x = a + dt_bias
        # softplus = log1p(exp(x)), linear past torch's threshold 20; log1p by Kahan's trick (log(1 + y) alone
        # loses the small g of a slowly decaying head)
        y = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
        softplus = tl.where(x > 20.0, x, log1p)
        return -tl.exp(a_log) * softplus, tl.sigmoid(b)

    @triton.jit
    def _gdn_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, n_heads, stride_a, stride_b,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_kernels(PDL)
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK)
        ok = h < n_heads
        a = tl.load(a_ptr + row * stride_a + h, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + h, mask=ok, other=0.0).to(tl.float32)
        g, beta = gdn_gate_values(a, b, tl.load(a_log_ptr + h, mask=ok, other=0.0).to(tl.float32),
                                  tl.load(dt_bias_ptr + h, mask=ok, other=0.0).to(tl.float32))
        tl.store(g_ptr + row * n_heads + h, g, mask=ok)
        tl.store(beta_ptr + row * n_heads + h, beta.to(beta_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gated_sum_kernel(parts_ptr, shared_ptr, logit_ptr, out_ptr, H, stride_shared, stride_logit,
                          TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_kernels(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], tl.float32)
        for k in range(TOP_K):
            acc += tl.load(parts_ptr + (t * TOP_K + k) * H + cols, mask=ok, other=0.0).to(tl.float32)
        gate = tl.sigmoid(tl.load(logit_ptr + t * stride_logit).to(tl.float32)).to(dt).to(tl.float32)
        shared = tl.load(shared_ptr + t * stride_shared + cols, mask=ok, other=0.0).to(tl.float32)
        gated = (gate * shared).to(dt).to(tl.float32)
        tl.store(out_ptr + t * H + cols, (acc.to(dt).to(tl.float32) + gated).to(dt), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, group=None) -> torch.Tensor:
    """`group`: as `sigmoid_gate`'s (the FP8 down projection's)."""
    return silu_mul_triton(gate, up, group=group) if use_triton(gate) else silu_mul_torch(gate, up)


def sigmoid_gate(x, gate, group=None):
    """x [T, heads * head_dim] (contiguous), gate [T, heads, head_dim] -> x * sigmoid(gate) [T, heads * head_dim].
    `group`: the kernel also writes the output's e4m3 groups for the FP8 GEMM that reads it (`tandem.ops.norm`)."""
    return sigmoid_gate_triton(x, gate, group=group) if use_triton(x) else sigmoid_gate_torch(x, gate)


def gdn_gates(a, b, a_log, dt_bias):
    """a, b [T, nv] -> (g [T, nv] fp32, beta [T, nv] in b's dtype)."""
    return gdn_gates_triton(a, b, a_log, dt_bias) if use_triton(a) else gdn_gates_torch(a, b, a_log, dt_bias)


def gated_sum(parts, shared, logit):
    """parts [T, top_k, H], shared [T, H], logit [T, 1] -> [T, H]."""
    return gated_sum_triton(parts, shared, logit) if use_triton(parts) else gated_sum_torch(parts, shared, logit)


def silu_mul_torch(gate, up):
    return F.silu(gate) * up


def sigmoid_gate_torch(x, gate):
    return x * torch.sigmoid(gate.reshape(x.shape))


def gdn_gates_torch(a, b, a_log, dt_bias):
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def gated_sum_torch(parts, shared, logit):
    return parts.sum(1) + torch.sigmoid(logit) * shared


def _row_major(x):
    """x [rows, cols] with unit column stride (a view into a fused projection's output is fine)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _column_groups(n: int, block: int, group) -> int:
    """`group`, when a kernel whose programs each write BLOCK columns of rows of n values can write them as whole
    e4m3 groups of `group` too, else 0."""
    return group if group and n % block == 0 and block % group == 0 else 0


def silu_mul_triton(gate, up, block=1024, group=None):
    shape, n = gate.shape, gate.shape[-1]
    gate, up = _row_major(gate.reshape(-1, n)), _row_major(up.reshape(-1, n))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(block, triton.next_power_of_2(n))
    g = _column_groups(n, block, group)
    q, s = group_buffers(out, g)
    if gate.shape[0]:
        _silu_mul_kernel[(gate.shape[0], triton.cdiv(n, block))](gate, up, out, q, s, n, gate.stride(0),
                                                                 up.stride(0), BLOCK=block, G=g, **pdl(gate))
    return attach_activation_groups(out.view(shape), q, s, g)


def sigmoid_gate_triton(x, gate, block=1024, group=None):
    T, n = x.shape
    assert x.is_contiguous() and gate.stride(2) == 1 and gate.shape[1] * gate.shape[2] == n
    out = torch.empty_like(x)
    block = min(block, triton.next_power_of_2(n))
    g = _column_groups(n, block, group)
    q, s = group_buffers(out, g)
    if T:
        _sigmoid_gate_kernel[(T, triton.cdiv(n, block))](x, gate, out, q, s, n, gate.stride(0), gate.stride(1),
                                                         HD=gate.shape[2], BLOCK=block, G=g, **pdl(x))
    return attach_activation_groups(out, q, s, g)


def gdn_gates_triton(a, b, a_log, dt_bias):
    a, b = _row_major(a), _row_major(b)
    T, nv = a.shape
    g = torch.empty(T, nv, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, nv, dtype=b.dtype, device=b.device)
    if T:
        _gdn_gates_kernel[(T,)](a, b, a_log, dt_bias, g, beta, nv, a.stride(0), b.stride(0),
                                BLOCK=triton.next_power_of_2(nv), **pdl(a))
    return g, beta


def gated_sum_triton(parts, shared, logit, block=1024):
    T, top_k, H = parts.shape
    parts, shared = parts.contiguous(), _row_major(shared)
    out = torch.empty(T, H, dtype=parts.dtype, device=parts.device)
    if T:
        block = min(block, triton.next_power_of_2(H))
        _gated_sum_kernel[(T, triton.cdiv(H, block))](parts, shared, logit, out, H, shared.stride(0), logit.stride(0),
                                                      TOP_K=top_k, BLOCK=block, **pdl(parts))
    return out
