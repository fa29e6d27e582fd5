"""Gated DeltaNet ops over the packed batch, reading and writing per-request state slots in place.

- `causal_conv1d`: depthwise causal conv (kernel K) + SiLU; the slot's conv state holds the previous K-1 inputs.
- `gated_delta_rule`: per value head, `S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q`, with q, k
  L2-normalised (eps 1e-6), q scaled by dk^-0.5 and key heads repeated over value heads. State in fp32. The gates
  come in as the layer's projections a, b with A_log and dt_bias (`Gates`): the recurrent kernel computes g and
  beta itself, one launch fewer per layer.

Request i reads and writes one state slot, `batch.state_slots[i]`. Speculative rows are kept, not committed: a
verify step's rows ([last token, drafts]) may be rejected, so it stores its request's state *before* them and keeps
the rows' inputs in a pending buffer (`pending [buffers, W, C + nk*dk + nv*dv + 2*nv]` per layer, W = k+1 rows of
conv input x | k | v | a | b); once the host knows how many were accepted, the request's next step replays that
many (`batch.state_replay[i]`) onto the state before its own rows. A verify step thus reads and writes one state,
where storing the state after every draft position would write k+1 (the recurrent state is 2 MB a request and
layer in the 35B-A3B: most of a verify step's GDN bytes). `batch.state_pending[i]` = (the buffer its replayed rows
are in, the buffer this step's rows go to, or -1: commit them, as prefill chunks and k = 0 decode rows do). Each
slot owns two buffers (2 * slot + 0/1, alternating between steps), so the programs of one request that still read
the replayed rows never race the ones writing the new rows.

Each op has a torch reference (walks requests one by one on the host) and GPU paths behind one dispatch; CUDA
tensors take the GPU paths:
- `causal_conv1d` -> `causal_conv1d_triton`, one kernel for decode, verify and varlen prefill rows: a program per
  (request, channel block, row split) computes tiles of rows from the K-1 inputs in the slot (after the replayed
  rows) and the request's rows, and the first split of each request writes the new state (and keeps the rows).
  With `splits` (GDN's q | k | v widths) it writes each part as a contiguous [T, width] block, so fla's prefill
  reads q, k and v without copying them.
- `gated_delta_rule` -> `gated_delta_rule_gpu`: requests of at most `FLA_MIN_ROWS` rows (decode, verify, short
  prefill chunks) run `gated_delta_rule_triton`, the recurrent kernel (state of one (request, value head, dv block)
  in registers, replayed rows then the request's rows in sequence). Longer requests -- prefill chunks, which
  neither replay nor keep rows -- run fla-core's chunked kernel when fla is importable (else the recurrent kernel
  too). A chunked form of the recurrent kernel (16-row chunks as tensor-core dots) was tried and measured 6x
  slower at verify rows on an H100 (docs/BENCHMARKS.md, tenth session): a verify request's few rows are too few.

Launches use only device metadata (query_start_loc, state_slots, state_replay, state_pending) inside the kernels;
the host lists in the batch choose grid sizes and loop bounds (no host synchronisation, capturable in a CUDA graph
for a decode/verify batch). Assumption shared with the reference: distinct requests use distinct slots (padding
rows may share the null slot, whose contents are garbage anyway).
"""

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.batch import ForwardBatch, to_device
from tandem.ops.pointwise import gdn_gates, gdn_gates_torch
from tandem.ops.triton_utils import HAS_TRITON, TORCH_OPS_ONLY, pdl, use_triton

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


def prefill_kernel(device: str) -> str:
    """Which kernel runs the delta rule over prompts on `device`, said once at start: without fla-core a GPU
    serves long prompts through the recurrent kernel, many times slower, and nothing else would show it."""
    if not (torch.device(device).type == "cuda" and HAS_TRITON and not TORCH_OPS_ONLY):
        return "GDN prefill: torch reference (no GPU kernels on this device)"
    if HAS_FLA:
        return f"GDN prefill: fla-core's chunked kernel above {FLA_MIN_ROWS} rows, Triton's recurrent kernel below"
    return ("GDN prefill: Triton's recurrent kernel at every length; fla-core is not installed, so long prompts "
            "prefill many times slower (pip install 'tandem[gpu]')")


def pending_width(conv_dim: int, nk: int, dk: int, nv: int, dv: int) -> int:
    """Width of a kept row in a layer's pending buffer: the conv's input x, then k | v | a | b for the delta rule."""
    return conv_dim + nk * dk + nv * dv + 2 * nv


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, pending: torch.Tensor, weight: torch.Tensor,
                  batch: ForwardBatch, splits: list[int] | None = None):
    """x: [T, C]; conv_state: [slots, C, K-1]; pending: [buffers, W, C] (the kept x rows); weight: [C, K] ->
    silu(conv(x)) [T, C], or with `splits` (channel widths, at most 3) its parts, each contiguous: fla's prefill
    then reads q, k and v without copying them."""
    if use_triton(x):
        return causal_conv1d_triton(x, conv_state, pending, weight, batch, splits)
    out = _causal_conv1d_torch(x, conv_state, pending, weight, batch)
    return out if splits is None else tuple(p.contiguous() for p in out.split(splits, dim=-1))


class Gates(NamedTuple):
    """A GDN layer's gate inputs: its projections a, b [T, nv] (strided views are fine) and the per-head A_log,
    dt_bias; `g = -exp(A_log) * softplus(a + dt_bias)` (fp32) and `beta = sigmoid(b)` (`tandem/ops/pointwise.py`),
    computed inside the recurrent kernel."""

    a: torch.Tensor
    b: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor


def gated_delta_rule(q, k, v, gates: Gates, state: torch.Tensor, pending: torch.Tensor, batch: ForwardBatch,
                     out=None) -> torch.Tensor:
    """q, k: [T, nk, dk]; v: [T, nv, dv]; state: [slots, nv, dk, dv]; pending: [buffers, W, nk*dk + nv*dv + 2*nv]
    (kept rows' k | v | a | b) -> o [T, nv, dv] (into `out` when given)."""
    if use_triton(v):
        return gated_delta_rule_gpu(q, k, v, gates, state, pending, batch, out=out)
    o = _gated_delta_rule_torch(q, k, v, gates, state, pending, batch)
    return o if out is None else out.copy_(o)


def _requests(batch: ForwardBatch):
    """(first row, end row, state slot, rows to replay, buffer they are in, buffer for this step's rows or -1)."""
    qsl = batch.query_start_loc_cpu
    for i, (slot, replay, (kept_in, keep_out)) in enumerate(zip(
            batch.state_slots.tolist(), batch.state_replay.tolist(), batch.state_pending.tolist())):
        yield qsl[i], qsl[i + 1], slot, replay, kept_in, keep_out


def _causal_conv1d_torch(x, conv_state, pending, weight, batch: ForwardBatch):
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    for start, end, slot, replay, kept_in, keep_out in _requests(batch):
        # every input so far: the slot's K-1, the replayed rows, this step's rows
        window = torch.cat([conv_state[slot], pending[kept_in, :replay].T.to(conv_state.dtype),
                            x[start:end].T.to(conv_state.dtype)], dim=1)
        y = F.conv1d(window[None, :, replay:].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
        out[start:end] = F.silu(y).T.to(x.dtype)
        committed = replay if keep_out >= 0 else replay + end - start  # inputs now part of the state
        conv_state[slot] = window[:, committed : committed + width]
        if keep_out >= 0:
            pending[keep_out, : end - start] = x[start:end]
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2_normalize_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., D] of one shape -> both L2-normalised over D in fp32, in their dtype, fresh tensors. CUDA tensors
    take one launch for the two (fla's kernel would otherwise normalise them first, by two launches of heavier
    host code)."""
    if use_triton(q):
        return l2_normalize_qk_triton(q, k, eps)
    return tuple(l2_normalize(x.float(), eps).to(x.dtype) for x in (q, k))


def l2_normalize_qk_triton(q, k, eps=1e-6):
    assert q.shape == k.shape and q.dtype == k.dtype
    D = q.shape[-1]
    qo, ko = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(2))
    n, br = q.numel() // D, 16
    if n:
        _l2_normalize_qk_kernel[(triton.cdiv(n, br), 2)](q.contiguous(), k.contiguous(), qo, ko, n, eps, D=D,
                                                         BD=_pow2(D), BR=br, num_warps=4, **pdl(q))
    return qo, ko


def _delta_rule_row(s, k, v, g, beta):
    """s [nv, dk, dv] fp32 after one row (k [nv, dk] normalised, v [nv, dv], g and beta [nv], all fp32)."""
    s = s * g.exp()[:, None, None]
    delta = (v - torch.einsum("hkv,hk->hv", s, k)) * beta[:, None]
    return s + k[:, :, None] * delta[:, None, :]


def _gated_delta_rule_torch(q, k, v, gates: Gates, state, pending, batch: ForwardBatch):
    nk, dk, nv, dv = q.shape[1], q.shape[2], v.shape[1], v.shape[2]

    def heads(x):  # [n, nk, dk] -> L2-normalised fp32 [n, nv, dk], key heads repeated over their value heads
        return l2_normalize(x.float()).repeat_interleave(nv // nk, dim=1)

    def gate_values(a, b):
        g, beta = gdn_gates_torch(a, b, gates.a_log, gates.dt_bias)
        return g.float(), beta.float()

    qf, kf, vf = heads(q) * dk**-0.5, heads(k), v.float()
    gf, bf = gate_values(gates.a, gates.b)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start, end, slot, replay, kept_in, keep_out in _requests(batch):
        s = state[slot].float()  # [nv, dk, dv]
        kp, vp, ap, bp = pending[kept_in, :replay].split([nk * dk, nv * dv, nv, nv], dim=-1)
        kpf, vpf, (gp, bpf) = heads(kp.view(replay, nk, dk)), vp.view(replay, nv, dv).float(), gate_values(ap, bp)
        for t in range(replay):
            s = _delta_rule_row(s, kpf[t], vpf[t], gp[t], bpf[t])
        if keep_out >= 0:  # speculative rows: the state before them is stored, they are kept for a replay
            state[slot] = s.to(state.dtype)
            n = end - start
            pending[keep_out, :n] = torch.cat([k[start:end].reshape(n, -1), v[start:end].reshape(n, -1),
                                               gates.a[start:end], gates.b[start:end]], dim=-1)
        for t in range(start, end):
            s = _delta_rule_row(s, kf[t], vf[t], gf[t], bf[t])
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        if keep_out < 0:
            state[slot] = s.to(state.dtype)
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels. Row loops are `while` loops over each request's runtime count (Triton's interpreter cannot take a
# tensor as a range() bound), and the counts that vary from step to step are not specialised on: a served step of
# new shape must not wait on a compile.

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.pointwise import gdn_gate_values
    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _delta_update(s, kv, vv, gt, bt):
        """One row of the delta rule on a state tile s [BK, BV] -> the state after it."""
        s = s * tl.exp(gt)
        delta = (vv - tl.sum(s * kv[:, None], axis=0)) * bt
        return s + kv[:, None] * delta[None, :]

    @triton.jit
    def _row(tile, r, j):
        """Row j of a [WP, N] tile whose row indices are r, as an [N] vector (a masked sum: no dynamic index)."""
        return tl.sum(tl.where((r == j)[:, None], tile, 0.0), axis=0)

    @triton.jit
    def _at(vec, r, j):
        """Element j of a [WP] vector whose indices are r."""
        return tl.sum(tl.where(r == j, vec, 0.0))

    @triton.jit
    def _rows(ptr, rows, row_st, col0, cols, live, mcols):
        """fp32 [len(rows), len(cols)] tile of ptr + rows * row_st + col0 + cols; 0 where not live."""
        return tl.load(ptr + (rows * row_st + col0)[:, None] + cols[None, :], mask=live[:, None] & mcols[None, :],
                       other=0.0).to(tl.float32)

    @triton.jit
    def _l2_normalize(x, eps):
        return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]

    @triton.jit(do_not_specialize=["n_rows"])
    def _l2_normalize_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, n_rows, eps, D: tl.constexpr, BD: tl.constexpr,
                                BR: tl.constexpr, PDL: tl.constexpr):
        """Rows [pid * BR, pid * BR + BR) of q into qo (program axis 1 = 0) or of k into ko (1), all [n_rows, D]
        contiguous: each row over its L2 norm, in fp32."""
        wait_for_prior_kernels(PDL)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BD)
        ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        if tl.program_id(1) == 0:
            x = tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(qo_ptr + offs, _l2_normalize(x, eps).to(qo_ptr.dtype.element_ty), mask=ok)
        else:
            x = tl.load(k_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(ko_ptr + offs, _l2_normalize(x, eps).to(ko_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _row_gates(a_ptr, b_ptr, t, a_st, b_st, h, a_log, dt_bias, live):
        """fp32 (g, beta) of rows t (a vector or a scalar) of value head h; rows not `live` get 0 and 0, which
        leave the state as it is."""
        ga, gb = gdn_gate_values(tl.load(a_ptr + t * a_st + h, mask=live, other=0.0).to(tl.float32),
                                 tl.load(b_ptr + t * b_st + h, mask=live, other=0.0).to(tl.float32), a_log, dt_bias)
        gb = gb.to(b_ptr.dtype.element_ty).to(tl.float32)  # beta in b's dtype, as the reference keeps it
        return tl.where(live, ga, 0.0), tl.where(live, gb, 0.0)

    @triton.jit(do_not_specialize=["max_rows", "p_ss"])
    def _gdn_recurrent_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, o_ptr, p_ptr, qsl_ptr, slots_ptr,
        replay_ptr, pend_ptr,
        q_st, q_sh, k_st, k_sh, v_st, v_sh, a_st, b_st, o_st, o_sh, s_ss, s_sh, s_sk, p_ss, p_sr,
        max_rows, scale, eps,
        NK: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, PDL: tl.constexpr,
    ):
        """One program per (request, value head, dv block); requests with more than max_rows rows are skipped.
        The gates g and beta come from the projections a, b (`Gates`). The replayed rows and the first W rows
        (all of a decode or verify request's) are loaded at once, before the state, so their loads overlap its
        load instead of each waiting for the row before; they run unrolled, a row past the end changing nothing
        (its g, beta and k are 0). Rows after them (short prefill chunks) run one by one. A kept row is stored
        by one program per part: k by head REP * kh's first dv block, v by its own block, a and b by block 0."""
        wait_for_prior_kernels(PDL)
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        start = tl.load(qsl_ptr + i).to(tl.int64)
        n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
        if n > max_rows:  # fla's
            return
        slot = tl.load(slots_ptr + i).to(tl.int64)
        n_replay = tl.load(replay_ptr + i)
        kept_in = p_ptr + tl.load(pend_ptr + 2 * i).to(tl.int64) * p_ss
        keep_out = tl.load(pend_ptr + 2 * i + 1).to(tl.int64)
        NV: tl.constexpr = NK * REP
        A_OFF: tl.constexpr = NK * DK + NV * DV  # a's column in a kept row, then b's
        kh = h // REP
        a_log = tl.load(a_log_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mk = offs_k < DK
        mv = offs_v < DV
        tile = offs_k[:, None] * s_sk + offs_v[None, :]
        mtile = mk[:, None] & mv[None, :]
        s_tile = state_ptr + slot * s_ss + h * s_sh + tile
        r = tl.arange(0, WP)
        rows = start + r
        live = (r < n) & (r < W)
        replayed = (r < n_replay) & (r < W)
        k_raw = _rows(k_ptr, rows, k_st, kh * k_sh, offs_k, live, mk)
        v_raw = _rows(v_ptr, rows, v_st, h * v_sh, offs_v, live, mv)
        qw = _l2_normalize(_rows(q_ptr, rows, q_st, kh * q_sh, offs_k, live, mk), eps) * scale
        kw = _l2_normalize(k_raw, eps)
        gw, bw = _row_gates(a_ptr, b_ptr, rows, a_st, b_st, h, a_log, dt_bias, live)
        kp = _l2_normalize(_rows(kept_in, r, p_sr, kh * DK, offs_k, replayed, mk), eps)
        vp = _rows(kept_in, r, p_sr, NK * DK + h * DV, offs_v, replayed, mv)
        gp, bp = _row_gates(kept_in + A_OFF, kept_in + A_OFF + NV, r, p_sr, p_sr, h, a_log, dt_bias, replayed)
        s = tl.load(s_tile, mask=mtile, other=0.0).to(tl.float32)  # [BK, BV]
        tl.debug_barrier()  # every thread has read the slot before any overwrites it
        for j in tl.static_range(W):  # the accepted rows of the request's previous step
            if j < n_replay:
                s = _delta_update(s, _row(kp, r, j), _row(vp, r, j), _at(gp, r, j), _at(bp, r, j))
        if keep_out >= 0:  # speculative rows: the state before them is stored, they are kept for the replay
            tl.store(s_tile, s.to(state_ptr.dtype.element_ty), mask=mtile)
            dst = p_ptr + keep_out * p_ss + r * p_sr
            p_dt = p_ptr.dtype.element_ty
            if vb == 0:
                if h % REP == 0:
                    tl.store(dst[:, None] + (kh * DK + offs_k)[None, :], k_raw.to(p_dt),
                             mask=live[:, None] & mk[None, :])
                tl.store(dst + A_OFF + h, tl.load(a_ptr + rows * a_st + h, mask=live), mask=live)
                tl.store(dst + A_OFF + NV + h, tl.load(b_ptr + rows * b_st + h, mask=live), mask=live)
            tl.store(dst[:, None] + (NK * DK + h * DV + offs_v)[None, :], v_raw.to(p_dt),
                     mask=live[:, None] & mv[None, :])
        for j in tl.static_range(W):
            s = _delta_update(s, _row(kw, r, j), _row(v_raw, r, j), _at(gw, r, j), _at(bw, r, j))
            ov = tl.sum(s * _row(qw, r, j)[:, None], axis=0)
            tl.store(o_ptr + (start + j) * o_st + h * o_sh + offs_v, ov.to(o_ptr.dtype.element_ty), mask=mv & (j < n))
        j = n * 0 + W
        while j < n:
            t = start + j
            qv = tl.load(q_ptr + t * q_st + kh * q_sh + offs_k, mask=mk, other=0.0).to(tl.float32)
            kv = tl.load(k_ptr + t * k_st + kh * k_sh + offs_k, mask=mk, other=0.0).to(tl.float32)
            qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + eps) * scale
            kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + eps)
            vv = tl.load(v_ptr + t * v_st + h * v_sh + offs_v, mask=mv, other=0.0).to(tl.float32)
            gt, bt = _row_gates(a_ptr, b_ptr, t, a_st, b_st, h, a_log, dt_bias, True)
            s = _delta_update(s, kv, vv, gt, bt)
            ov = tl.sum(s * qv[:, None], axis=0)
            tl.store(o_ptr + t * o_st + h * o_sh + offs_v, ov.to(o_ptr.dtype.element_ty), mask=mv)
            j += 1
        if keep_out < 0:
            tl.store(s_tile, s.to(state_ptr.dtype.element_ty), mask=mtile)

    @triton.jit
    def _earlier_inputs(cs_row, kept_in, pos, live, cols, mc, cs_sc, cs_sk, p_sr, K: tl.constexpr):
        """[len(pos), BC] inputs from before this step's rows, at positions `pos` of (the slot's K-1 inputs, then
        the replayed rows, kept in the pending buffer)."""
        in_state = live & (pos < K - 1)
        in_kept = live & (pos >= K - 1)
        sv = tl.load(cs_row + cols[None, :] * cs_sc + pos[:, None] * cs_sk, mask=in_state[:, None] & mc[None, :],
                     other=0.0)
        kv = tl.load(kept_in + (pos - (K - 1))[:, None] * p_sr + cols[None, :], mask=in_kept[:, None] & mc[None, :],
                     other=0.0)
        return tl.where(in_state[:, None], sv, kv.to(sv.dtype))

    @triton.jit(do_not_specialize=["T", "split", "p_ss", "req0"])
    def _causal_conv1d_kernel(
        x_ptr, cs_ptr, w_ptr, o_ptr, p_ptr, qsl_ptr, slots_ptr, replay_ptr, pend_ptr,
        x_st, cs_ss, cs_sc, cs_sk, w_sc, w_sk, p_ss, p_sr, C, T, S0, S1, split, req0,
        K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (request req0 + i, channel block, split); split p computes row tiles p, p+split, ... of
        its request. Only tile 0 reads the inputs from before the step (BT >= K-1 whenever there is more than one
        tile), and split 0 writes the new state (and keeps the rows) after all its reads. The output is planar:
        channels [0, S0), [S0, S1) and [S1, C) are three contiguous [T, width] blocks one after another
        (S0 = S1 = C: one [T, C] block)."""
        wait_for_prior_kernels(PDL)
        i = req0 + tl.program_id(0)
        cb = tl.program_id(1)
        p = tl.program_id(2)
        start = tl.load(qsl_ptr + i).to(tl.int64)
        n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
        cs_row = cs_ptr + tl.load(slots_ptr + i).to(tl.int64) * cs_ss
        n_replay = tl.load(replay_ptr + i)
        kept_in = p_ptr + tl.load(pend_ptr + 2 * i).to(tl.int64) * p_ss
        keep_out = tl.load(pend_ptr + 2 * i + 1).to(tl.int64)
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
                m = rows + (tap - (K - 1))  # input index; < 0: from before this step
                from_x = (m >= 0) & mr
                xv = tl.load((x_rows + (tap - (K - 1)) * x_st)[:, None] + cols[None, :],
                             mask=from_x[:, None] & mc[None, :], other=0.0).to(cs_dt)
                if j0 < K - 1:  # the first tile: its first rows read the inputs from before this step
                    ev = _earlier_inputs(cs_row, kept_in, n_replay + (K - 1) + m, (m < 0) & mr, cols, mc, cs_sc,
                                         cs_sk, p_sr, K)
                    win = tl.where(from_x[:, None], xv, ev)
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
            # The new state: the K-1 inputs up to the last committed one (the replayed rows, and this step's
            # unless they are kept), at positions of (slot's K-1, replayed rows, this step's rows). All of it is
            # loaded before anything is stored: the slot is read and written.
            e = tl.arange(0, KP)
            ke = e < K - 1
            pos = n_replay + tl.where(keep_out >= 0, 0, n) + e
            xi = pos - (K - 1) - n_replay  # this step's row at that position
            from_x = ke & (xi >= 0)
            xv = tl.load(x_ptr + (start + xi)[:, None] * x_st + cols[None, :], mask=from_x[:, None] & mc[None, :],
                         other=0.0).to(cs_dt)
            vals = tl.where(from_x[:, None], xv, _earlier_inputs(cs_row, kept_in, pos, ke & (xi < 0), cols, mc,
                                                                 cs_sc, cs_sk, p_sr, K))  # [KP, BC]
            r = tl.arange(0, WP)
            keep = (r < n) & (r < W) & (keep_out >= 0)
            kept = tl.load(x_ptr + (start + r)[:, None] * x_st + cols[None, :], mask=keep[:, None] & mc[None, :])
            tl.debug_barrier()
            tl.store(cs_row + cols[None, :] * cs_sc + e[:, None] * cs_sk, vals, mask=ke[:, None] & mc[None, :])
            tl.store(p_ptr + keep_out * p_ss + r[:, None] * p_sr + cols[None, :], kept.to(p_ptr.dtype.element_ty),
                     mask=keep[:, None] & mc[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _lens(batch: ForwardBatch) -> list[int]:
    qsl = batch.query_start_loc_cpu
    return [b - a for a, b in zip(qsl[:-1], qsl[1:])]


def _pending_metadata(batch: ForwardBatch, pending: torch.Tensor) -> int:
    """Checks what the kernels read of the batch's pending metadata; returns W, the rows a buffer keeps."""
    assert batch.state_pending.shape[1] == 2 and batch.state_pending.stride() == (2, 1)
    assert pending.stride(2) == 1
    return pending.shape[1]


def gated_delta_rule_triton(q, k, v, gates: Gates, state, pending, batch: ForwardBatch, out=None, max_rows=None,
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
    B, W = len(lens), _pending_metadata(batch, pending)
    # The tiling (prefill_ops.py --rows recurrent --sweep): decode rows 32 wide x 4 warps; verify rows fewer warps,
    # so fewer of each row's reductions over the keys cross warps: 32 x 2 for few requests, 16 x 1 from 16 (an
    # H100 at B = 32: 77 us against 86 for 64 x 2, the H200 sweep's best without 1-warp tiles, where the two cards
    # agreed within 10% on every tiling both ran)
    many = B * nv >= 512
    if block_v is None:
        block_v = min(32 if W == 1 or not many else 16, _pow2(dv))
    if num_warps is None:
        num_warps = 4 if W == 1 else 1 if many else 2
    grid = (B, nv, triton.cdiv(dv, block_v))
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, gates.a_log, gates.dt_bias, state, out, pending, batch.query_start_loc, batch.state_slots,
        batch.state_replay, batch.state_pending,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), pending.stride(0),
        pending.stride(1), max(todo) if max_rows is None else max_rows, dk**-0.5, 1e-6,
        NK=nk, REP=nv // nk, DK=dk, DV=dv, BK=_pow2(dk), BV=block_v, W=W, WP=_pow2(W),
        num_warps=num_warps, **pdl(q)
    )
    return out


def gated_delta_rule_fla(q, k, v, gates: Gates, state, batch: ForwardBatch, requests: list[int], out=None):
    """fla's chunked kernel over `requests` (prefill chunks longer than FLA_MIN_ROWS rows, which neither replay
    nor keep rows: the engine only keeps a verify step's rows): initial states gathered from their slots, final
    states written back; fills their rows of `out`. Without `out`, the requests must be all the batch's rows:
    fla's own output is returned (no copy). The gates are computed by their own launch here (prefill sizes: one
    launch more is nothing), q and k normalised by one (`l2_normalize_qk`) rather than fla's two, and the slots'
    states moved by index_select / index_copy_ rather than indexing: a third less host time in these cores
    (py-spy on served mixed steps, which were device-bound: docs/BENCHMARKS.md, eighth session)."""
    qsl = batch.query_start_loc_cpu
    spans = [(qsl[i], qsl[i + 1]) for i in requests]
    assert all(b - a > FLA_MIN_ROWS for a, b in spans)
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
        idx, cu_dev, chunks = to_device(v.device, torch.tensor(requests, dtype=torch.long), cu_cpu, chunks)
        batch.derived[key] = (cu_cpu, batch.state_slots.index_select(0, idx), cu_dev, chunks)
    cu_cpu, slots, cu_dev, chunk_indices = batch.derived[key]
    h0 = state.index_select(0, slots).float()
    g, beta = gdn_gates(*gates)  # over every row: the same strides (and kernel variant) whatever the split
    qn, kn = l2_normalize_qk(rows(q), rows(k))
    o, ht = _fla_chunk_gated_delta_rule(
        qn[None], kn[None], rows(v)[None], rows(g)[None], rows(beta)[None],
        scale=q.shape[2] ** -0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
    )
    state.index_copy_(0, slots, ht.to(state.dtype))
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


def gated_delta_rule_gpu(q, k, v, gates: Gates, state, pending, batch: ForwardBatch, out=None):
    """Recurrent kernel for requests of at most FLA_MIN_ROWS rows, fla's chunked kernel for longer ones (or the
    recurrent kernel for all when fla is missing)."""
    lens = _lens(batch)
    long = [i for i, n in enumerate(lens) if n > FLA_MIN_ROWS] if HAS_FLA else []
    assert FLA_MIN_ROWS >= pending.shape[1]  # kept (verify) rows never go to fla
    if not long:
        return gated_delta_rule_triton(q, k, v, gates, state, pending, batch, out=out)
    if out is None and len(long) == len(lens):  # a prefill of long prompts only: fla's output as it is
        return gated_delta_rule_fla(q, k, v, gates, state, batch, long)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if len(long) < len(lens):
        gated_delta_rule_triton(q, k, v, gates, state, pending, batch, out=out, max_rows=FLA_MIN_ROWS)
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


def causal_conv1d_triton(x, conv_state, pending, weight, batch: ForwardBatch, splits=None, out=None, block_c=None,
                         split=None, block_t=None):
    """x: [T, C]; conv_state: [slots, C, K-1]; pending: [buffers, W, C]; weight: [C, K] -> silu(conv(x)) [T, C],
    states written in place.
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
    B, W = len(lens), _pending_metadata(batch, pending)
    bt = block_t or min(8, _pow2(max_n))  # [8, 128] tiles: larger ones spilled registers on sm_90
    tiles = triton.cdiv(max_n, bt)
    assert tiles == 1 or bt >= K - 1
    bc = block_c or min(128, _pow2(C))
    while any(e % bc for e in ends[:-1]):  # a channel block lies in one part
        bc //= 2
    ncb = triton.cdiv(C, bc)
    # A mixed step's decode requests (one row tile each) come first: the prompt chunks after them are a launch of
    # their own, so that the split spreads their row tiles over programs instead of counting the decode requests
    # (32 decode requests and 2 prompts of ~1000 rows: split 4, each program walking ~30 tiles one by one).
    cut = next((r for r, n in enumerate(lens) if n > bt), B) if split is None else B
    for r0, r1 in ((0, cut), (cut, B)):
        if r0 == r1:
            continue
        sub_split = split or _conv_split(r1 - r0, triton.cdiv(max(lens[r0:r1]), bt), ncb)
        _causal_conv1d_kernel[(r1 - r0, ncb, sub_split)](
            x, conv_state, weight, out, pending, batch.query_start_loc, batch.state_slots, batch.state_replay,
            batch.state_pending, x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            weight.stride(0), weight.stride(1), pending.stride(0), pending.stride(1), C, T, s0, s1, sub_split, r0,
            K=K, KP=_pow2(K - 1), W=W, WP=_pow2(W), BC=bc, BT=bt, num_warps=4, **pdl(x),
        )
    return _planar(out, T, splits)


def _conv_split(requests: int, tiles: int, channel_blocks: int) -> int:
    """Programs per (request, channel block): long prompts' row tiles spread over up to ~8192 programs (a
    program's tiles run one after another, latency-bound)."""
    split = 1
    while split < tiles and requests * channel_blocks * split < 8192:
        split *= 2
    return min(split, _pow2(tiles))
