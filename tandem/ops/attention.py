"""Paged causal attention over the packed batch (prefill chunks and decode tokens together).

KV caches are per layer `[num_blocks, block_size, kv_heads, head_dim]`; request i's context is the first
`seq_lens[i]` slots of its block table, and its queries are the last `q_len` of those positions.
"""

import torch

from tandem.model.batch import ForwardBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
    return _paged_attention_torch(q, k_cache, v_cache, batch, scale)


def _paged_attention_torch(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    qsl = batch.query_start_loc_cpu
    for i, ctx in enumerate(batch.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        n_blocks = -(-ctx // block_size)
        blocks = batch.block_tables[i, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[-1])[:ctx].repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[-1])[:ctx].repeat_interleave(group, dim=1)
        qi = q[start:end]
        scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * scale
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
