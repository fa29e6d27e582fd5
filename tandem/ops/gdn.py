"""Gated DeltaNet ops over the packed batch, reading and writing per-request state slots in place.

- `causal_conv1d`: depthwise causal conv (kernel K) + SiLU; the slot's conv state holds the previous K-1 inputs.

Both start from `batch.state_slots[i]` and write the state after row j of request i into
`batch.state_write_slots[i, min(j, W-1)]`: with W = 1 that is the request's one slot; when verifying k drafts
(W = k+1) each position's state is kept, so the next step starts from the last accepted one without recompute.
- `gated_delta_rule`: per value head, `S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q`, with q, k
  L2-normalised (eps 1e-6), q scaled by dk^-0.5 and key heads repeated over value heads. State in fp32.
"""

import torch
import torch.nn.functional as F

from tandem.model.batch import ForwardBatch


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """x: [T, C]; conv_state: [slots, C, K-1]; weight: [C, K] -> silu(conv(x)) [T, C]."""
    return _causal_conv1d_torch(x, conv_state, weight, batch)


def gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q, k: [T, nk, dk]; v: [T, nv, dv]; g, beta: [T, nv]; state: [slots, nv, dk, dv] -> o [T, nv, dv]."""
    return _gated_delta_rule_torch(q, k, v, g, beta, state, batch)


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
