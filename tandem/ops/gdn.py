"""Gated DeltaNet ops over the packed batch, reading and writing per-request state slots in place.

- `causal_conv1d`: depthwise causal conv (kernel K) + SiLU; the slot's conv state holds the previous K-1 inputs.

Both start from `batch.state_slots[i]` and write the state after row j of request i into
`batch.state_write_slots[i, min(j, W-1)]`: with W = 1 that is the request's one slot; when verifying k drafts
(W = k+1) each position's state is kept, so the next step starts from the last accepted one without recompute.
- `gated_delta_rule`: per value head, `S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q`, with q, k
  L2-normalised (eps 1e-6), q scaled by dk^-0.5 and key heads repeated over value heads. State in fp32. The gates
  come in as the layer's projections a, b with A_log and dt_bias (`Gates`): the recurrent kernel computes g and
  beta itself, one launch fewer per layer.

Each op has a torch reference (walks requests one by one on the host) and GPU paths behind one dispatch; CUDA
tensors take the GPU paths:
- `causal_conv1d` -> `causal_conv1d_triton`, one kernel for decode, verify and varlen prefill rows: a program per
  (request, channel block, row split) computes tiles of rows from the K-1 inputs in the slot and the request's rows,
  and the first split of each request writes the kept states. With `splits` (GDN's q | k | v widths) it writes
  each part as a contiguous [T, width] block, so fla's prefill reads q, k and v without copying them.
- `gated_delta_rule` -> `gated_delta_rule_gpu`: requests of at most `FLA_MIN_ROWS` rows (decode, verify, short
  prefill chunks) run `gated_delta_rule_triton`, the recurrent kernel (state of one (request, value head, dv block)
  in registers, rows in sequence, every kept state written where the reference writes it). Longer requests -- prefill
  chunks -- run fla-core's chunked kernel when fla is importable (else the recurrent kernel too), which only returns
  the final state: it goes to column min(n-1, W-1) = W-1 (n > FLA_MIN_ROWS >= W), the column the engine reads after
  a prefill chunk (`read_slot_index = min(n, W) - 1`). Columns 0..W-2 of such a chunk are left untouched (the
  reference writes the states after its first W-1 rows there, which nothing reads).

Launches use only device metadata (query_start_loc, state_slots, state_write_slots) inside the kernels; the host
lists in the batch choose grid sizes and loop bounds (no host synchronisation, capturable in a CUDA graph for a
decode/verify batch). Assumption shared with the reference: distinct requests write distinct slots (padding rows may
share the null slot, whose contents are garbage anyway).
"""

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.model.batch import ForwardBatch, to_device
from tandem.ops.pointwise import gdn_gates, gdn_gates_torch
from tandem.ops.triton_utils import HAS_TRITON, use_triton

try:  # optional GPU dependency (fla-core): the chunked prefill kernel
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices as _fla_chunk_indices

    HAS_FLA = True
except Exception:  # noqa: BLE001 -- absent, or present but unusable on this machine
    _fla_chunk_gated_delta_rule = _fla_chunk_indices = None
    HAS_FLA = False
FLA_CHUNK = 64  # fla's chunk length (its default); the chunk indices we pass are built for it

# Requests with more rows than this go to fla's chunked kernel (when present); it must be >= W (= k+1).
FLA_MIN_ROWS = 64


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch,
                  splits: list[int] | None = None):
    """x: [T, C]; conv_state: [slots, C, K-1]; weight: [C, K] -> silu(conv(x)) [T, C], or with `splits` (channel
    widths, at most 3) its parts, each contiguous: fla's prefill then reads q, k and v without copying them."""
    if use_triton(x):
        return causal_conv1d_triton(x, conv_state, weight, batch, splits)
    out = _causal_conv1d_torch(x, conv_state, weight, batch)
    return out if splits is None else tuple(p.contiguous() for p in out.split(splits, dim=-1))


class Gates(NamedTuple):
    """A GDN layer's gate inputs: its projections a, b [T, nv] (strided views are fine) and the per-head A_log,
    dt_bias; `g = -exp(A_log) * softplus(a + dt_bias)` (fp32) and `beta = sigmoid(b)` (`tandem/ops/pointwise.py`),
    computed inside the recurrent kernel."""

    a: torch.Tensor
    b: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor


def gated_delta_rule(q, k, v, gates: Gates, state: torch.Tensor, batch: ForwardBatch, out=None) -> torch.Tensor:
    """q, k: [T, nk, dk]; v: [T, nv, dv]; state: [slots, nv, dk, dv] -> o [T, nv, dv] (into `out` when given)."""
    if use_triton(v):
        return gated_delta_rule_gpu(q, k, v, gates, state, batch, out=out)
    o = _gated_delta_rule_torch(q, k, v, *gdn_gates_torch(*gates), state, batch)
    return o if out is None else out.copy_(o)


def _causal_conv1d_torch(x, conv_state, weight, batch: ForwardBatch):
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    qsl = batch.query_start_loc_cpu
    writes = batch.state_write_slots.tolist()
    for i, slot in enumerate(batch.state_slots.tolist()):
        start, end = qsl[i], qsl[i + 1]
        window = torch.cat([conv_state[slot], x[start:end].T.to(conv_state.dtype)], dim=1)  # [C, K-1+n]
        y = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
        out[start:end] = F.silu(y).T.to(x.dtype)
        for j in _kept_rows(end - start, len(writes[i])):
            conv_state[writes[i][min(j, len(writes[i]) - 1)]] = window[:, j + 1 : j + 1 + width]
    return out


def _kept_rows(n: int, width: int) -> list[int]:
    """Rows whose following state is stored: the first width-1 and the last."""
    return sorted(set(range(min(n, width - 1))) | {n - 1})


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gated_delta_rule_torch(q, k, v, g, beta, state, batch: ForwardBatch):
    nv, dk = v.shape[1], q.shape[2]
    rep = nv // q.shape[1]
    qf = l2_normalize(q.float()).repeat_interleave(rep, dim=1) * dk**-0.5
    kf = l2_normalize(k.float()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qsl = batch.query_start_loc_cpu
    writes = batch.state_write_slots.tolist()
    for i, slot in enumerate(batch.state_slots.tolist()):
        s = state[slot].float()  # [nv, dk, dv]
        kept = _kept_rows(qsl[i + 1] - qsl[i], len(writes[i]))
        for j, t in enumerate(range(qsl[i], qsl[i + 1])):
            s = s * gf[t].exp()[:, None, None]
            kv_mem = torch.einsum("hkv,hk->hv", s, kf[t])
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
            if j in kept:
                state[writes[i][min(j, len(writes[i]) - 1)]] = s.to(state.dtype)
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels. Row loops are `while` loops over each request's runtime count (Triton's interpreter cannot take a
# tensor as a range() bound), and the counts that vary from step to step are not specialised on: a served step of
# new shape must not wait on a compile.

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.pointwise import gdn_gate_values

    @triton.jit
    def _delta_step(s, qv, kv, vv, gt, bt):
        """One row of the delta rule on a state tile s [BK, BV] -> (the state after it, the row's output [BV])."""
        s = s * tl.exp(gt)
        delta = (vv - tl.sum(s * kv[:, None], axis=0)) * bt
        s = s + kv[:, None] * delta[None, :]
        return s, tl.sum(s * qv[:, None], axis=0)

    @triton.jit
    def _row(tile, r, j):
        """Row j of a [WP, N] tile whose row indices are r, as an [N] vector (a masked sum: no dynamic index)."""
        return tl.sum(tl.where((r == j)[:, None], tile, 0.0), axis=0)

    @triton.jit
    def _row_gates(a_ptr, b_ptr, t, a_st, b_st, h, a_log, dt_bias, live):
        """fp32 (g, beta) of rows t (a vector or a scalar) of value head h; rows not `live` get 0 and 0, which
        leave the state as it is."""
        ga, gb = gdn_gate_values(tl.load(a_ptr + t * a_st + h, mask=live, other=0.0).to(tl.float32),
                                 tl.load(b_ptr + t * b_st + h, mask=live, other=0.0).to(tl.float32), a_log, dt_bias)
        gb = gb.to(b_ptr.dtype.element_ty).to(tl.float32)  # beta in b's dtype, as the reference keeps it
        return tl.where(live, ga, 0.0), tl.where(live, gb, 0.0)

    @triton.jit(do_not_specialize=["max_rows", "ws_st"])
    def _gdn_recurrent_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, wslots_ptr,
        q_st, q_sh, k_st, k_sh, v_st, v_sh, a_st, b_st, o_st, o_sh, s_ss, s_sh, s_sk, ws_st,
        max_rows, scale, eps,
        REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr,
    ):
        """One program per (request, value head, dv block); requests with more than max_rows rows are skipped.
        The gates g and beta come from the projections a, b (`Gates`). The first W rows (all of a decode or
        verify request's) are loaded at once, before the state, so their loads overlap its load instead of each
        waiting for the row before; they run unrolled, a row past the request's end changing nothing (its g,
        beta and k are 0). Rows after them (short prefill chunks) run one by one."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        start = tl.load(qsl_ptr + i).to(tl.int64)
        n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
        n = tl.where(n > max_rows, 0, n)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        kh = h // REP
        a_log = tl.load(a_log_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < DK
        mv = offs_v < DV
        tile = offs_k[:, None] * s_sk + offs_v[None, :]
        mtile = mk[:, None] & mv[None, :]
        r = tl.arange(0, WP)
        rows = start + r
        live = (r < n) & (r < W)
        qw = tl.load(q_ptr + (rows * q_st + kh * q_sh)[:, None] + offs_k[None, :], mask=live[:, None] & mk[None, :],
                     other=0.0).to(tl.float32)
        kw = tl.load(k_ptr + (rows * k_st + kh * k_sh)[:, None] + offs_k[None, :], mask=live[:, None] & mk[None, :],
                     other=0.0).to(tl.float32)
        vw = tl.load(v_ptr + (rows * v_st + h * v_sh)[:, None] + offs_v[None, :], mask=live[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        gw, bw = _row_gates(a_ptr, b_ptr, rows, a_st, b_st, h, a_log, dt_bias, live)
        qw = qw * (tl.rsqrt(tl.sum(qw * qw, axis=1) + eps) * scale)[:, None]
        kw = kw * tl.rsqrt(tl.sum(kw * kw, axis=1) + eps)[:, None]
        s = tl.load(state_ptr + slot * s_ss + h * s_sh + tile, mask=mtile, other=0.0).to(tl.float32)  # [BK, BV]
        tl.debug_barrier()  # the read slot may be one this program overwrites below
        for j in tl.static_range(W):
            s, ov = _delta_step(s, _row(qw, r, j), _row(kw, r, j), _row(vw, r, j), tl.sum(tl.where(r == j, gw, 0.0)),
                                tl.sum(tl.where(r == j, bw, 0.0)))
            tl.store(o_ptr + (start + j) * o_st + h * o_sh + offs_v, ov.to(o_ptr.dtype.element_ty), mask=mv & (j < n))
            dst = tl.load(wslots_ptr + i * ws_st + j).to(tl.int64)
            keep = (j < n) & ((j < W - 1) | (j == n - 1))  # the kept rows (`_kept_rows`)
            tl.store(state_ptr + dst * s_ss + h * s_sh + tile, s.to(state_ptr.dtype.element_ty), mask=mtile & keep)
        j = n * 0 + W
        while j < n:
            t = start + j
            qv = tl.load(q_ptr + t * q_st + kh * q_sh + offs_k, mask=mk, other=0.0).to(tl.float32)
            kv = tl.load(k_ptr + t * k_st + kh * k_sh + offs_k, mask=mk, other=0.0).to(tl.float32)
            qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + eps) * scale
            kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + eps)
            vv = tl.load(v_ptr + t * v_st + h * v_sh + offs_v, mask=mv, other=0.0).to(tl.float32)
            gt, bt = _row_gates(a_ptr, b_ptr, t, a_st, b_st, h, a_log, dt_bias, True)
            s, ov = _delta_step(s, qv, kv, vv, gt, bt)
            tl.store(o_ptr + t * o_st + h * o_sh + offs_v, ov.to(o_ptr.dtype.element_ty), mask=mv)
            if j == n - 1:  # the last row's state, to column W-1
                last = tl.load(wslots_ptr + i * ws_st + W - 1).to(tl.int64)
                tl.store(state_ptr + last * s_ss + h * s_sh + tile, s.to(state_ptr.dtype.element_ty), mask=mtile)
            j += 1

    @triton.jit(do_not_specialize=["T", "split", "ws_st"])
    def _causal_conv1d_kernel(
        x_ptr, cs_ptr, w_ptr, o_ptr, qsl_ptr, slots_ptr, wslots_ptr,
        x_st, cs_ss, cs_sc, cs_sk, w_sc, w_sk, ws_st, C, T, S0, S1, split,
        K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    ):
        """One program per (request, channel block, split); split p computes row tiles p, p+split, ... of its
        request. Only tile 0 reads the slot's inputs (BT >= K-1 whenever there is more than one tile), and split 0
        writes the kept states after all its reads. The output is planar: channels [0, S0), [S0, S1) and [S1, C)
        are three contiguous [T, width] blocks one after another (S0 = S1 = C: one [T, C] block)."""
        i = tl.program_id(0)
        cb = tl.program_id(1)
        p = tl.program_id(2)
        start = tl.load(qsl_ptr + i).to(tl.int64)
        n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
        slot = tl.load(slots_ptr + i).to(tl.int64)
        c0 = cb * BC
        cols = c0 + tl.arange(0, BC)
        mc = cols < C
        # this channel block's part (blocks never straddle two): its [T, width] block starts at seg_start * T
        seg_start = tl.where(c0 < S0, 0, tl.where(c0 < S1, S0, S1)).to(tl.int64)
        seg_width = tl.where(c0 < S0, S0, tl.where(c0 < S1, S1 - S0, C - S1))
        o_block = o_ptr + seg_start * T + (c0 - seg_start)
        cs_dt = cs_ptr.dtype.element_ty
        w_dt = w_ptr.dtype.element_ty
        j0 = p * BT
        while j0 < n:
            rows = j0 + tl.arange(0, BT)
            mr = rows < n
            x_rows = x_ptr + (start + rows) * x_st
            acc = tl.zeros([BT, BC], dtype=tl.float32)
            for tap in tl.static_range(K):
                m = rows + (tap - (K - 1))  # input index; < 0: from the slot's K-1 previous inputs
                from_x = (m >= 0) & mr
                xv = tl.load((x_rows + (tap - (K - 1)) * x_st)[:, None] + cols[None, :],
                             mask=from_x[:, None] & mc[None, :], other=0.0).to(cs_dt)
                if j0 < K - 1:  # the first tile: its first rows read the slot's inputs
                    from_s = (m < 0) & mr
                    sv = tl.load(cs_ptr + slot * cs_ss + cols[None, :] * cs_sc + (K - 1 + m)[:, None] * cs_sk,
                                 mask=from_s[:, None] & mc[None, :], other=0.0)
                    win = tl.where(from_x[:, None], xv, sv)
                else:
                    win = xv
                wt = tl.load(w_ptr + cols * w_sc + tap * w_sk, mask=mc, other=0.0).to(tl.float32)
                acc += win.to(w_dt).to(tl.float32) * wt[None, :]
            y = acc.to(w_dt).to(tl.float32)  # the reference convolves and applies SiLU in the weight dtype
            y = (y * tl.sigmoid(y)).to(w_dt)
            tl.store(o_block + (start + rows)[:, None] * seg_width + tl.arange(0, BC)[None, :],
                     y.to(o_ptr.dtype.element_ty), mask=mr[:, None] & mc[None, :])
            j0 += split * BT
        if p == 0:
            # The state after row j is inputs j-K+2 .. j. Column c < W-1 keeps row c (if c < n), column W-1 row
            # n-1 (if n >= W). All kept states are loaded before any is stored: a write slot may be the read slot.
            f = tl.arange(0, WP * KP)
            c = f // KP
            e = f % KP
            keep = (c < W) & (e < K - 1) & (((c < W - 1) & (c < n)) | ((c == W - 1) & (n >= W)))
            j = tl.where(c < W - 1, c, n - 1)
            m = j - (K - 2) + e
            xv = tl.load(x_ptr + (start + m)[None, :] * x_st + cols[:, None],
                         mask=(keep & (m >= 0))[None, :] & mc[:, None], other=0.0).to(cs_dt)
            sv = tl.load(cs_ptr + slot * cs_ss + cols[:, None] * cs_sc + (K - 1 + m)[None, :] * cs_sk,
                         mask=(keep & (m < 0))[None, :] & mc[:, None], other=0.0)
            vals = tl.where((m >= 0)[None, :], xv, sv)  # [BC, WP*KP]
            dst = tl.load(wslots_ptr + i * ws_st + tl.minimum(c, W - 1)).to(tl.int64)
            tl.debug_barrier()
            tl.store(cs_ptr + dst[None, :] * cs_ss + cols[:, None] * cs_sc + e[None, :] * cs_sk, vals,
                     mask=keep[None, :] & mc[:, None])


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _lens(batch: ForwardBatch) -> list[int]:
    qsl = batch.query_start_loc_cpu
    return [b - a for a, b in zip(qsl[:-1], qsl[1:])]


def gated_delta_rule_triton(q, k, v, gates: Gates, state, batch: ForwardBatch, out=None, max_rows=None,
                            block_v=None, num_warps=None):
    """The recurrent kernel over every request with at most `max_rows` rows (all when None); the others' rows of
    `out` are left as they are. Returns out [T, nv, dv] in v's dtype. block_v, num_warps: the tiling (a benchmark's
    sweep; None: the default)."""
    T, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    a, b = gates.a, gates.b
    assert nv % nk == 0 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert state.stride(3) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    lens = _lens(batch)
    todo = [n for n in lens if max_rows is None or n <= max_rows]
    if not todo or max(todo) == 0:
        return out
    B, W = len(lens), batch.state_write_slots.shape[1]
    if block_v is None:  # enough programs to fill the GPU: 16-wide dv blocks when the batch is small
        block_v = min(32, _pow2(dv))
        while block_v > 16 and B * nv * triton.cdiv(dv, block_v) < 512:
            block_v //= 2
    wslots = batch.state_write_slots
    grid = (B, nv, triton.cdiv(dv, block_v))
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, gates.a_log, gates.dt_bias, state, out, batch.query_start_loc, batch.state_slots, wslots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), wslots.stride(0),
        max(todo) if max_rows is None else max_rows, dk**-0.5, 1e-6,
        REP=nv // nk, DK=dk, DV=dv, BK=_pow2(dk), BV=block_v, W=W, WP=_pow2(W),
        num_warps=num_warps or (8 if block_v >= 32 else 4),
    )
    return out


def gated_delta_rule_fla(q, k, v, gates: Gates, state, batch: ForwardBatch, requests: list[int], out=None):
    """fla's chunked kernel over `requests` (each longer than W rows): initial states gathered from their read
    slots, final states written to column W-1 of their write slots; fills their rows of `out`. Without `out`,
    the requests must be all the batch's rows: fla's own output is returned (no copy). The gates are computed by
    their own launch here (prefill sizes: one launch more is nothing)."""
    qsl, W = batch.query_start_loc_cpu, batch.state_write_slots.shape[1]
    spans = [(qsl[i], qsl[i + 1]) for i in requests]
    assert all(b - a > W for a, b in spans)
    contiguous = all(spans[r][1] == spans[r + 1][0] for r in range(len(spans) - 1))

    def rows(x):
        r = x[spans[0][0] : spans[-1][1]] if contiguous else torch.cat([x[a:b] for a, b in spans])
        # fla's kernels are specialised on 16-byte aligned pointers: a view that starts off that (the bf16 beta of
        # a model with few value heads, after an odd number of decode rows) would compile a variant mid-serving
        return r if r.data_ptr() % 16 == 0 else r.clone()

    key = ("fla", tuple(requests))
    if key not in batch.derived:  # once per step, not per layer: the same tensors also hit fla's own caches
        cu_cpu = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        chunks = _fla_chunk_indices(cu_cpu, FLA_CHUNK)
        batch.derived[key] = (cu_cpu, *to_device(v.device, torch.tensor(requests, dtype=torch.long), cu_cpu, chunks))
    cu_cpu, idx, cu_dev, chunk_indices = batch.derived[key]
    h0 = state[batch.state_slots[idx]].float()
    g, beta = gdn_gates(*gates)  # over every row: the same strides (and kernel variant) whatever the split
    o, ht = _fla_chunk_gated_delta_rule(
        rows(q)[None], rows(k)[None], rows(v)[None], rows(g)[None], rows(beta)[None],
        scale=q.shape[2] ** -0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
    )
    state[batch.state_write_slots[idx, W - 1]] = ht.to(state.dtype)
    o = o[0].to(v.dtype)
    if out is None:
        assert contiguous and spans[0][0] == 0 and spans[-1][1] == v.shape[0]
        return o
    if contiguous:
        out[spans[0][0] : spans[-1][1]] = o
    else:
        for (a, b), c0 in zip(spans, cu_cpu.tolist()):
            out[a:b] = o[c0 : c0 + b - a]
    return out


def gated_delta_rule_gpu(q, k, v, gates: Gates, state, batch: ForwardBatch, out=None):
    """Recurrent kernel for requests of at most FLA_MIN_ROWS rows, fla's chunked kernel for longer ones (or the
    recurrent kernel for all when fla is missing)."""
    lens = _lens(batch)
    long = [i for i, n in enumerate(lens) if n > FLA_MIN_ROWS] if HAS_FLA else []
    assert FLA_MIN_ROWS >= batch.state_write_slots.shape[1]
    if not long:
        return gated_delta_rule_triton(q, k, v, gates, state, batch, out=out)
    if out is None and len(long) == len(lens):  # a prefill of long prompts only: fla's output as it is
        return gated_delta_rule_fla(q, k, v, gates, state, batch, long)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if len(long) < len(lens):
        gated_delta_rule_triton(q, k, v, gates, state, batch, out=out, max_rows=FLA_MIN_ROWS)
    return gated_delta_rule_fla(q, k, v, gates, state, batch, long, out)


def _planar(out: torch.Tensor, T: int, splits) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """out (T * C elements) as the conv's result: [T, C], or the contiguous [T, width] part of each split."""
    if splits is None:
        return out
    flat, parts, start = out.view(-1), [], 0
    for width in splits:
        parts.append(flat[start * T : (start + width) * T].view(T, width))
        start += width
    return tuple(parts)


def causal_conv1d_triton(x, conv_state, weight, batch: ForwardBatch, splits=None, out=None, block_c=None,
                         split=None, block_t=None):
    """x: [T, C]; conv_state: [slots, C, K-1]; weight: [C, K] -> silu(conv(x)) [T, C], states written in place.
    `splits` (at most 3 channel widths summing to C): the parts, each a contiguous [T, width] view of `out`."""
    T, C = x.shape
    K = weight.shape[1]
    assert K >= 2 and x.stride(1) == 1 and conv_state.shape[2] == K - 1
    if out is None:
        out = torch.empty_like(x)
    assert out.is_contiguous() and out.numel() == T * C
    ends = list(itertools.accumulate(splits or [C]))
    assert len(ends) <= 3 and ends[-1] == C
    s0, s1 = (ends[:-1] + [C, C])[:2]  # the kernel's part boundaries (fewer parts: the later ones empty)
    lens = _lens(batch)
    max_n = max(lens) if lens else 0
    if max_n == 0:
        return _planar(out, T, splits)
    B, W = len(lens), batch.state_write_slots.shape[1]
    bt = block_t or min(8, _pow2(max_n))  # [8, 128] tiles: larger ones spilled registers on sm_90
    tiles = triton.cdiv(max_n, bt)
    assert tiles == 1 or bt >= K - 1
    bc = block_c or min(128, _pow2(C))
    while any(e % bc for e in ends[:-1]):  # a channel block lies in one part
        bc //= 2
    ncb = triton.cdiv(C, bc)
    if split is None:
        split = 1
        # spread long prefill rows over more programs: a program's tiles run one after another, latency-bound
        while split < tiles and B * ncb * split < 8192:
            split *= 2
        split = min(split, _pow2(tiles))
    wslots = batch.state_write_slots
    _causal_conv1d_kernel[(B, ncb, split)](
        x, conv_state, weight, out, batch.query_start_loc, batch.state_slots, wslots,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), weight.stride(0),
        weight.stride(1), wslots.stride(0), C, T, s0, s1, split,
        K=K, KP=_pow2(K - 1), W=W, WP=_pow2(W), BC=bc, BT=bt, num_warps=4,
    )
    return _planar(out, T, splits)
