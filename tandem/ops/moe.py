"""Mixture of experts: fp32 softmax routing, top-k, optional renormalisation, SwiGLU experts.

Expert weights are fused: `gate_up [E, 2I, H]` (gate rows first) and `down [E, H, I]`.
"""

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    probs = F.linear(x, router_weight).softmax(dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def fused_experts(x, gate_up, down, weights, experts) -> torch.Tensor:
    """x: [T, H]; weights, experts: [T, top_k] -> [T, H]."""
    return _fused_experts_torch(x, gate_up, down, weights, experts)


def _fused_experts_torch(x, gate_up, down, weights, experts):
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]
    w_of = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * w_of[start : start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out
