"""A training-time Qwen3.5-MoE model (trunk + MTP head) in plain torch, with autograd over [B, L] batches.

Parameter names and shapes are those of Tandem's `Qwen3_5ForCausalLM` (`model.*`, `lm_head.weight`, `mtp.*`, experts
fused as `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`), so exporting is a rename of `model.` to the official
`model.language_model.` prefix. The maths is Tandem's (and HF's): zero-centred RMSNorm, partial rotate-half RoPE,
gated attention with an interleaved q/gate projection, Gated DeltaNet (computed chunk-wise here), fp32-softmax top-k
routing with renormalisation plus a sigmoid-gated shared expert. `training/check.py` pins this module against
Tandem and HF transformers in fp32.

The MTP head is trained the way Tandem drafts with it (tandem/model/mtp.py, tandem/engine/spec.py): at position p
level 1 reads the trunk's post-norm hidden h_p and embed(x_{p+1}) and predicts x_{p+2}; level j > 1 reads the
head's own level-(j-1) output at p-1 and embed(x_{p+1}). Its attention sees what the MTP KV cache holds when that
draft is made: level-1 keys at positions <= p-j+1 and the level-i key at p-j+i for each 2 <= i <= j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float

    @classmethod
    def from_hf(cls, text: dict) -> "TextConfig":
        rope = text["rope_parameters"]
        names = [f for f in cls.__dataclass_fields__ if f not in ("rope_theta", "partial_rotary_factor")]
        return cls(**{n: text[n] for n in names}, rope_theta=rope["rope_theta"],
                   partial_rotary_factor=rope["partial_rotary_factor"])


def rms1p(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


class RMSNorm1p(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return rms1p(x, self.weight, self.eps)


def _linear(i, o):
    return nn.Linear(i, o, bias=False)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = 64):
    """q, k: [B, L, h, dk] (normalised, q scaled); v: [B, L, h, dv]; g, beta: [B, L, h]; all fp32; zero initial
    state. Per head: S_t = e^{g_t} S_{t-1} + k_t d_t^T with d_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t); o_t = S_t^T q_t.
    Within a chunk (cumulative log decay c_i, G_ij = e^{c_i - c_j}) the new values solve
    (I + strict_lower(beta_i G_ij k_i.k_j)) D = beta V - beta e^{c} K S_0, so D = U - W S_0; then
    O = e^{c} Q S_0 + lower(G_ij q_i.k_j) D and S_C = e^{c_C} S_0 + (e^{c_C - c} K)^T D."""
    B, L, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    N = (L + pad) // chunk

    def heads_first(t):  # [B, L, h, ...] -> [B, h, N, C, ...]
        t = t.transpose(1, 2)
        return t.reshape(B, h, N, chunk, *t.shape[3:])

    q, k, v, g, beta = map(heads_first, (q, k, v, g, beta))
    c = g.cumsum(-1)  # [B, h, N, C]
    lower = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device))
    strict = torch.tril(lower, -1)
    diff = c[..., :, None] - c[..., None, :]
    decay_incl = diff.masked_fill(~lower, 0.0).exp() * lower
    decay_strict = decay_incl * strict
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    M = eye + A
    U = torch.linalg.solve_triangular(M, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(M, kb * c.exp()[..., None], upper=False, unitriangular=True)
    P = (q @ k.transpose(-1, -2)) * decay_incl
    qg = q * c.exp()[..., None]
    kd = k * (c[..., -1:] - c).exp()[..., None]
    last = c[..., -1].exp()  # [B, h, N]
    S = q.new_zeros(B, h, dk, dv)
    outs = []
    for n in range(N):
        d = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + P[:, :, n] @ d)
        S = last[:, :, n, None, None] * S + kd[:, :, n].transpose(-1, -2) @ d
    o = torch.stack(outs, 2).reshape(B, h, N * chunk, dv).transpose(1, 2)
    return o[:, :L]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        H = cfg.hidden_size
        self.in_proj_qkv = _linear(H, conv_dim)
        self.in_proj_z = _linear(H, self.nv * self.dv)
        self.in_proj_b = _linear(H, self.nv)
        self.in_proj_a = _linear(H, self.nv)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.eps = cfg.rms_norm_eps
        self.out_proj = _linear(self.nv * self.dv, H)

    def forward(self, x, rope=None):
        B, L, _ = x.shape
        K = self.conv1d.weight.shape[-1]
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        qkv = F.silu(F.conv1d(qkv, self.conv1d.weight.to(qkv.dtype), padding=K - 1, groups=qkv.shape[1])[..., :L])
        qkv = qkv.transpose(1, 2)
        q, k, v = qkv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        rep = self.nv // self.nk
        q = (l2norm(q.float().view(B, L, self.nk, self.dk)) * self.dk**-0.5).repeat_interleave(rep, 2)
        k = l2norm(k.float().view(B, L, self.nk, self.dk)).repeat_interleave(rep, 2)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        o = chunk_gated_delta_rule(q, k, v.float().view(B, L, self.nv, self.dv), g, beta)
        o = o.to(x.dtype)
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        z = self.in_proj_z(x).view(B, L, self.nv, self.dv)
        o = ((self.norm.weight.to(x.dtype) * normed) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(B, L, -1))


def rope_cos_sin(positions, rotary_dim, theta, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    f = positions.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, heads, L, hd]; cos, sin: [L, rd]."""
    rd = cos.shape[-1]
    rot, keep = x[..., :rd], x[..., rd:]
    x1, x2 = rot.chunk(2, -1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], -1) * sin, keep], -1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = _linear(H, self.nh * self.hd * 2)
        self.k_proj = _linear(H, self.nkv * self.hd)
        self.v_proj = _linear(H, self.nkv * self.hd)
        self.o_proj = _linear(self.nh * self.hd, H)
        self.q_norm = RMSNorm1p(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm1p(self.hd, cfg.rms_norm_eps)

    def forward(self, x, rope, prefix_kv=None, mask=None):
        """Causal over x unless `mask` ([L, Lk] bool, True = attend) is given for keys prefix_kv + x's own.
        Returns (output, (k, v)) with k, v: [B, nkv, L, hd]."""
        B, L, _ = x.shape
        cos, sin = rope
        q, gate = self.q_proj(x).view(B, L, self.nh, 2 * self.hd).chunk(2, -1)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, L, self.nkv, self.hd).transpose(1, 2)
        keys, vals = (k, v) if prefix_kv is None else (torch.cat([prefix_kv[0], k], 2), torch.cat([prefix_kv[1], v], 2))
        rep = self.nh // self.nkv  # kv head i serves query heads i*rep .. i*rep+rep-1
        o = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1),
                                           attn_mask=mask, is_causal=mask is None, scale=self.hd**-0.5)
        o = o.transpose(1, 2).reshape(B, L, -1) * torch.sigmoid(gate.reshape(B, L, -1))
        return self.o_proj(o), (k, v)


class MLP(nn.Module):
    def __init__(self, H, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(H, inter), _linear(H, inter), _linear(inter, H)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Every expert is computed for every token and weighted by the (sparse) top-k routing weights: the same
    function and gradients as sparse dispatch, as a few large matrix products (cheap at this size)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.E, self.top_k, self.inter = E, cfg.num_experts_per_tok, inter
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, H))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.experts.down_proj = nn.Parameter(torch.empty(E, H, inter))
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = _linear(H, 1)

    def forward(self, x):
        """Returns (output, load-balancing loss)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        T, E, inter = x2.shape[0], self.E, self.inter
        probs = F.linear(x2, self.gate.weight.to(x2.dtype)).softmax(-1, dtype=torch.float32)
        w, idx = probs.topk(self.top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        dense_w = torch.zeros_like(probs).scatter(1, idx, w).to(x2.dtype)  # [T, E]
        gu = F.linear(x2, self.experts.gate_up_proj.to(x2.dtype).reshape(E * 2 * inter, -1)).view(T, E, 2 * inter)
        gate, up = gu.split(inter, -1)
        act = F.silu(gate) * up * dense_w[..., None]  # [T, E, I]
        down = self.experts.down_proj.to(x2.dtype).permute(1, 0, 2).reshape(shape[-1], E * inter)
        routed = F.linear(act.reshape(T, E * inter), down)
        out = routed + torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        frac = torch.zeros(E, device=x.device).scatter_add_(0, idx.flatten(), torch.ones(idx.numel(), device=x.device))
        aux = E * (frac / idx.numel() * probs.mean(0)).sum()
        return out.view(shape), aux


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, is_attention: bool):
        super().__init__()
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoE(cfg)
        self.input_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, prefix_kv=None, mask=None):
        x = self.input_layernorm(h)
        kv = None
        if self.is_attention:
            a, kv = self.self_attn(x, rope, prefix_kv, mask)
        else:
            a = self.linear_attn(x)
        h = h + a
        m, aux = self.mlp(self.post_attention_layernorm(h))
        return h + m, aux, kv


class MTPHead(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm1p(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm1p(H, cfg.rms_norm_eps)
        self.fc = _linear(2 * H, H)
        self.layers = nn.ModuleList([DecoderLayer(cfg, is_attention=True)])
        self.norm = RMSNorm1p(H, cfg.rms_norm_eps)


def mtp_mask(level: int, n: int, device) -> torch.Tensor:
    """[n, level*n] bool: the level-`level` query at position p sees level-1 keys at q <= p-level+1 and the level-i
    key at p-level+i (2 <= i <= level)."""
    p = torch.arange(n, device=device)[:, None]
    q = torch.arange(n, device=device)[None, :]
    blocks = [q <= p - level + 1] + [q == p - level + i for i in range(2, level + 1)]
    return torch.cat(blocks, 1)


class TinyQwen35Moe(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, t == "full_attention") for t in cfg.layer_types)
        self.model.norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTPHead(cfg)
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)

    @torch.no_grad()
    def init_weights(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        n_layers = self.cfg.num_hidden_layers
        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                b = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-b, b, generator=gen))
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
                    std = 0.02 / math.sqrt(2 * n_layers)  # residual-branch outputs
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    def rope(self, n, device, dtype):
        return rope_cos_sin(torch.arange(n, device=device), self.rotary_dim, self.cfg.rope_theta, dtype)

    def trunk(self, ids):
        """ids [B, L] -> (post-norm hidden [B, L, H], summed load-balancing loss)."""
        h = self.model.embed_tokens(ids)
        rope = self.rope(ids.shape[1], ids.device, h.dtype if not torch.is_autocast_enabled() else torch.bfloat16)
        aux = 0.0
        for layer in self.model.layers:
            h, a, _ = layer(h, rope)
            aux = aux + a
        return self.model.norm(h), aux

    def mtp_levels(self, hidden, ids, levels: int):
        """MTP outputs (post-norm, [B, L-1, H]) for levels 1..levels; row p of each predicts ids[:, p+2]."""
        m = self.mtp
        n = ids.shape[1] - 1
        emb = m.pre_fc_norm_embedding(self.model.embed_tokens(ids[:, 1:]))
        rope = self.rope(n, ids.device, emb.dtype if not torch.is_autocast_enabled() else torch.bfloat16)
        outs, keys, vals, aux = [], [], [], 0.0
        prev = hidden[:, :n]
        for level in range(1, levels + 1):
            if level > 1:  # the previous level's output at p-1
                prev = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            u = m.fc(torch.cat([emb, m.pre_fc_norm_hidden(prev)], -1))
            if level == 1:
                o, a, (k, v) = m.layers[0](u, rope)
            else:
                mask = mtp_mask(level, n, ids.device)
                o, a, (k, v) = m.layers[0](u, rope, (torch.cat(keys, 2), torch.cat(vals, 2)), mask)
            keys.append(k)
            vals.append(v)
            outs.append(m.norm(o))
            aux = aux + a
        return outs, aux

    def logits(self, hidden):
        return self.lm_head(hidden)


def param_count(cfg_text: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyQwen35Moe(TextConfig.from_hf(cfg_text)).parameters())
