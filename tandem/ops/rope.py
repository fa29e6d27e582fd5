"""Partial rotary embedding (rotate-half) over the first `rotary_dim` dims of each head, after the per-head q / k
RMSNorm1p of gated attention.

Qwen3.5's interleaved mRoPE sections collapse to plain 1-D RoPE for text (all three position axes are equal).

`rope_tables(batch, inv_freq, dtype)` makes the cos / sin tables of the batch's positions once per forward (every
attention layer shares them). `qk_norm_rope_write_kv` is the dispatch: the torch reference (norm, then rotate, then
the paged-cache write) or one Triton launch for all q and k heads of a layer that also writes the keys and values
into their cache slots, and rounds to the model dtype where the reference does (the normed head, the cos / sin
tables, each product and their sum).
"""

import torch

from tandem.batch import ForwardBatch
from tandem.ops.attention import write_kv
from tandem.ops.norm import rms_norm_1p
from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, NH, NKV, eps,
                             HD: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (t, h): query head h of token t for h < NH, else key head h - NH, which goes to the token's
        slot of the key cache, and its value head (copied as it is) to the value cache."""
        wait_for_prior_kernels(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        ok = d < HD
        if h < NH:
            x_ptr, w_ptr, o_ptr = q_ptr + t * stride_qt + h * stride_qh, qw_ptr, qo_ptr + (t * NH + h) * HD
        else:
            kv = h - NH
            slot = tl.load(slot_ptr + t).to(tl.int64)
            x_ptr, w_ptr, o_ptr = k_ptr + t * stride_kt + kv * stride_kh, kw_ptr, kc_ptr + (slot * NKV + kv) * HD
            v = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=ok)
            tl.store(vc_ptr + (slot * NKV + kv) * HD + d, v.to(vc_ptr.dtype.element_ty), mask=ok)
        dt = o_ptr.dtype.element_ty
        x = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        normed = (x * inv * (1.0 + w)).to(dt).to(tl.float32)
        # rotate-half partner of each rotary dim: -x[d + HALF] below HALF, x[d - HALF] above
        rot = d < 2 * HALF
        p = tl.where(d < HALF, d + HALF, d - HALF)
        xp = tl.load(x_ptr + p, mask=rot, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + p, mask=rot, other=0.0).to(tl.float32)
        partner = (xp * inv * (1.0 + wp)).to(dt).to(tl.float32)
        partner = tl.where(d < HALF, -partner, partner)
        j = tl.where(d < HALF, d, d - HALF)
        c = tl.load(cos_ptr + t * HALF + j, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * HALF + j, mask=rot, other=0.0).to(tl.float32)
        rotated = (normed * c).to(dt).to(tl.float32) + (partner * s).to(dt).to(tl.float32)
        tl.store(o_ptr + d, tl.where(rot, rotated, normed).to(dt), mask=ok)


def inv_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    # fp32 on purpose: bf16 inverse frequencies lose exactness at long positions
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_tables(batch: ForwardBatch, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) [T, rotary_dim / 2] in `dtype` for the batch's positions (fp32 angles), made by the first
    attention layer of a forward and kept in `batch.derived` for the others."""
    key = ("rope", inv_freq.data_ptr(), dtype)
    if key not in batch.derived:
        freqs = batch.positions.float()[:, None] * inv_freq[None, :]
        batch.derived[key] = (freqs.cos().to(dtype), freqs.sin().to(dtype))
    return batch.derived[key]


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping):
    """q [T, nh, hd], k and v [T, nkv, hd] (strided views are fine) -> RoPE(RMSNorm1p(q)) (contiguous); the keys
    RoPE(RMSNorm1p(k)) and the values v go to the caches at `slot_mapping` (one launch on the GPU: the keys are
    never written anywhere else)."""
    if use_triton(q):
        return qk_norm_rope_write_kv_triton(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                                            slot_mapping)
    q, k = qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin)
    write_kv(k_cache, v_cache, slot_mapping, k, v)
    return q


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim / 2] in x's dtype."""
    half = cos.shape[1]
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    rot, keep = x[..., : 2 * half], x[..., 2 * half :]
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated_half * sin, keep), dim=-1)


def qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin):
    return (apply_partial_rope(rms_norm_1p(q, q_weight, eps), cos, sin),
            apply_partial_rope(rms_norm_1p(k, k_weight, eps), cos, sin))


def qk_norm_rope_write_kv_triton(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping):
    T, nh, hd = q.shape
    nkv = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (nkv, hd)
    q_out = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
    if T:
        _qk_norm_rope_kernel[(T, nh + nkv)](
            q, k, v, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), nh, nkv, eps, HD=hd, HALF=cos.shape[1],
            BLOCK=triton.next_power_of_2(hd), **pdl(q))
    return q_out
