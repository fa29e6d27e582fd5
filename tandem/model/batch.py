"""The packed batch every forward consumes: all tokens of all requests in one `[T]` vector.

Rows are ordered request by request (decode requests first); request i owns tokens
`query_start_loc[i]:query_start_loc[i+1]`. Passed explicitly to every layer (no global context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0 = null block
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (block * block_size + offset) of each token
    state_slots: torch.Tensor  # [B] int64, GDN state slot each request starts from
    state_write_slots: torch.Tensor  # [B, W] int64: the state after row j goes to column min(j, W-1)
    logits_indices: torch.Tensor  # [B] int64, rows whose logits are wanted (each request's last token)
    # Host copies: the kernels take grid sizes from query_start_loc_cpu; the torch reference ops walk requests one
    # by one with both. A captured decode graph has no host lengths (seq_lens_cpu None): only kernels run there.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int] | None
