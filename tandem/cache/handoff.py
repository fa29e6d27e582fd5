"""What a prefilled request's state is, as named tensors: the prefill worker gathers it, the decode worker scatters it.

- each full-attention layer (and the MTP layer): K and V of the blocks covering the prompt, in order. The MTP
  entries the prefill worker wrote past the prompt (its k-1 recursive draft rows) are not sent: the decode
  worker rewrites those positions before any read of them.
- each GDN layer: the conv and recurrent state after the last prompt token, from the slot the next step reads;
  the decode worker puts it in the request's first slot (read_slot_index 0).

The block tables differ on the two sides; only contents move, block i of the prompt into the lease's block i.
"""

from __future__ import annotations

import torch

from tandem.cache.pools import CachePools
from tandem.config import ModelConfig
from tandem.engine.sequence import Sequence


def _named_caches(cfg: ModelConfig, pools: CachePools):
    """(name, tensor, kind) of every cache tensor; kind is "kv" (indexed by block) or "state" (by slot)."""
    for i, (t, (a, b)) in enumerate(zip(cfg.layer_types, pools.layer_caches)):
        if t == "full_attention":
            yield f"layers.{i}.k", a, "kv"
            yield f"layers.{i}.v", b, "kv"
        else:
            yield f"layers.{i}.conv", a, "state"
            yield f"layers.{i}.recurrent", b, "state"
    if pools.mtp_cache is not None:
        yield "mtp.k", pools.mtp_cache[0], "kv"
        yield "mtp.v", pools.mtp_cache[1], "kv"


def num_prompt_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def expected_shapes(cfg: ModelConfig, pools: CachePools, num_tokens: int, block_size: int) -> dict:
    """name -> (dtype, shape) of the state of a `num_tokens`-token prompt: what a hand-off must contain."""
    n = num_prompt_blocks(num_tokens, block_size)
    return {name: (t.dtype, [n, *t.shape[1:]] if kind == "kv" else [1, *t.shape[1:]])
            for name, t, kind in _named_caches(cfg, pools)}


def gather_state(cfg: ModelConfig, pools: CachePools, seq: Sequence, block_size: int) -> list[tuple[str, torch.Tensor]]:
    """Copies of the prompt's state (safe to free the sequence's blocks and slots right after)."""
    n = num_prompt_blocks(len(seq.prompt_token_ids), block_size)
    dev = pools.layer_caches[0][0].device
    blocks = torch.tensor(seq.block_ids[:n], device=dev)
    slot = torch.tensor([seq.state_slots[seq.read_slot_index]], device=dev)
    return [(name, t[blocks if kind == "kv" else slot]) for name, t, kind in _named_caches(cfg, pools)]


def scatter_state(cfg: ModelConfig, pools: CachePools, seq: Sequence, tensors: dict[str, torch.Tensor],
                  block_size: int) -> None:
    """Writes a received state into the sequence's lease blocks and its first state slot."""
    n = num_prompt_blocks(len(seq.prompt_token_ids), block_size)
    dev = pools.layer_caches[0][0].device
    blocks = torch.tensor(seq.block_ids[:n], device=dev)
    slot = torch.tensor([seq.state_slots[0]], device=dev)
    for name, t, kind in _named_caches(cfg, pools):
        t[blocks if kind == "kv" else slot] = tensors[name].to(dev)
    seq.read_slot_index = 0
