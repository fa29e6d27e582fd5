"""Partial rotary embedding (rotate-half) over the first `rotary_dim` dims of each head.

Qwen3.5's interleaved mRoPE sections collapse to plain 1-D RoPE for text (all three position axes are equal).
"""

import torch


def inv_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    # fp32 on purpose: bf16 inverse frequencies lose exactness at long positions
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; positions: [T]."""
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)
