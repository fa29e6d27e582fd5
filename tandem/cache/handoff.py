"""What a prefilled request's state is, as named tensors: the prefill worker gathers it, the decode worker scatters it.

- each full-attention layer (and the MTP layer): K and V of the blocks covering the prompt, in order. The MTP
  entries the prefill worker wrote past the prompt (its k-1 recursive draft rows) are not sent: the decode
  worker rewrites those positions before any read of them.
- each GDN layer: the conv and recurrent state after the last prompt token, from the request's slot (prompt rows
  are committed: nothing is pending) into the lease's slot.

The block tables differ on the two sides; only contents move, block i of the prompt into the lease's block i.

Under tensor parallelism each rank holds only its heads of every cache tensor (see `state_splits`). The state
still travels in the one-rank layout, so a prefill worker and a decode worker of any tensor-parallel sizes can
hand off to each other: rank 0 gathers every rank's slices of the prompt's blocks and slot and joins them along
the head dim (`gather_across_ranks`), and a decode worker's rank 0 cuts a received state by head and scatters
the slices (`scatter_across_ranks`). Every rank runs these functions together (rank 0's `LeaderModel` sends the
others the command).
"""

from __future__ import annotations

import torch

from tandem.cache.pools import CachePools
from tandem.config import ModelConfig
from tandem.engine.sequence import Sequence
from tandem.parallel import Split


def state_splits(cfg: ModelConfig) -> dict[str, Split]:
    """How the full (one-rank) cache tensors are cut across tensor-parallel ranks, by kind: KV
    [blocks, block_size, kv_heads, head_dim] by KV head; the GDN conv state [slots, conv_dim, K-1] by channel
    within each of its q | k | v parts (as the conv1d weight, `GatedDeltaNet.tp_splits`); the recurrent state
    [slots, nv, dk, dv] by value head."""
    qk = cfg.gdn_num_k_heads * cfg.gdn_k_dim
    return {"kv": Split(2), "conv": Split(1, (qk, qk, cfg.gdn_num_v_heads * cfg.gdn_v_dim)), "recurrent": Split(1)}


def _named_caches(cfg: ModelConfig, pools: CachePools):
    """(name, tensor, kind, split) of every cache tensor (this rank's heads); kind is "kv" (indexed by block) or
    "state" (by slot); split says how the full tensor is cut across ranks."""
    splits = state_splits(cfg)
    for i, (t, (a, b, *_)) in enumerate(zip(cfg.layer_types, pools.layer_caches)):  # not the pending buffers
        if t == "full_attention":
            yield f"layers.{i}.k", a, "kv", splits["kv"]
            yield f"layers.{i}.v", b, "kv", splits["kv"]
        else:
            yield f"layers.{i}.conv", a, "state", splits["conv"]
            yield f"layers.{i}.recurrent", b, "state", splits["recurrent"]
    if pools.mtp_cache is not None:
        yield "mtp.k", pools.mtp_cache[0], "kv", splits["kv"]
        yield "mtp.v", pools.mtp_cache[1], "kv", splits["kv"]


def num_prompt_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _local_shape(t: torch.Tensor, kind: str, num_blocks: int) -> list[int]:
    return [num_blocks if kind == "kv" else 1, *t.shape[1:]]


def expected_shapes(cfg: ModelConfig, pools: CachePools, num_tokens: int, block_size: int) -> dict:
    """name -> (dtype, shape) of the state of a `num_tokens`-token prompt: what a hand-off must contain (the
    full model's shapes, whatever this worker's tensor-parallel size)."""
    n, world = num_prompt_blocks(num_tokens, block_size), pools.tp.world_size
    out = {}
    for name, t, kind, split in _named_caches(cfg, pools):
        shape = _local_shape(t, kind, n)
        shape[split.dim] *= world
        out[name] = (t.dtype, shape)
    return out


def gather_across_ranks(cfg: ModelConfig, pools: CachePools, block_ids: list[int],
                        slot: int) -> list[tuple[str, torch.Tensor]] | None:
    """Copies of the state in `block_ids` and `slot`, in the full model's layout: rank 0 gets them (every rank's
    heads joined), the other ranks None. Every rank calls it together (on one rank: just the copies)."""
    dev = pools.layer_caches[0][0].device
    blocks, slots = torch.tensor(block_ids, device=dev), torch.tensor([slot], device=dev)
    caches = list(_named_caches(cfg, pools))
    parts = pools.tp.gather([t[blocks if kind == "kv" else slots] for _, t, kind, _ in caches])
    if parts is None:
        return None
    return [(name, split.join(p)) for (name, _, _, split), p in zip(caches, parts)]


def scatter_across_ranks(cfg: ModelConfig, pools: CachePools, block_ids: list[int], slot: int,
                         tensors: dict[str, torch.Tensor] | None) -> None:
    """Writes a state in the full model's layout (rank 0 passes it, the other ranks None) into `block_ids` and
    `slot`: each rank its own heads. Every rank calls it together."""
    dev = pools.layer_caches[0][0].device
    blocks, slots = torch.tensor(block_ids, device=dev), torch.tensor([slot], device=dev)
    caches, tp = list(_named_caches(cfg, pools)), pools.tp
    parts = None if tensors is None else [split.cut(tensors[name].to(dev), tp.world_size)
                                          for name, _, _, split in caches]
    like = None if tp.world_size == 1 else [torch.empty(_local_shape(t, kind, len(block_ids)), dtype=t.dtype,
                                                        device=dev) for _, t, kind, _ in caches]
    for (_, t, kind, _), part in zip(caches, tp.scatter(parts, like)):
        t[blocks if kind == "kv" else slots] = part


def gather_state(cfg: ModelConfig, pools: CachePools, seq: Sequence, block_size: int,
                 model=None) -> list[tuple[str, torch.Tensor]]:
    """Copies of the prompt's state (safe to free the sequence's blocks and slots right after). `model`: the
    engine's model; rank 0's `LeaderModel` under tensor parallelism, which has the other ranks send their heads."""
    n = num_prompt_blocks(len(seq.prompt_token_ids), block_size)
    assert seq.pending_rows == 0, "a prompt's state has no pending rows"
    args = (seq.block_ids[:n], seq.state_slots[0])
    if hasattr(model, "on_all_ranks"):
        return model.on_all_ranks("gather_state", *args, here=lambda: gather_across_ranks(cfg, pools, *args))
    return gather_across_ranks(cfg, pools, *args)


def scatter_state(cfg: ModelConfig, pools: CachePools, seq: Sequence, tensors: dict[str, torch.Tensor],
                  block_size: int, model=None) -> None:
    """Writes a received state (full model layout) into the sequence's lease blocks and its state slot;
    under tensor parallelism (`model` is rank 0's `LeaderModel`) each rank gets its heads."""
    n = num_prompt_blocks(len(seq.prompt_token_ids), block_size)
    args = (seq.block_ids[:n], seq.state_slots[0])
    if hasattr(model, "on_all_ranks"):
        model.on_all_ranks("scatter_state", *args, here=lambda: scatter_across_ranks(cfg, pools, *args, tensors))
    else:
        scatter_across_ranks(cfg, pools, *args, tensors)
    seq.pending_rows = 0
