"""The packed batch every forward consumes: all tokens of all requests in one `[T]` vector.

Rows are ordered request by request (decode requests first); request i owns tokens
`query_start_loc[i]:query_start_loc[i+1]`. Passed explicitly to every layer (no global context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int64 (every index tensor is int64: one kernel variant for all)
    seq_lens: torch.Tensor  # [B] int64, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, 0 = null block
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (block * block_size + offset) of each token
    state_slots: torch.Tensor  # [B] int64, the GDN state slot each request reads and writes
    # GDN rows kept pending (`tandem/ops/gdn.py`): [B] int64, rows of the request's previous (verify) step applied
    # to its state before its own rows; [B, 2] int64, (the pending buffer those rows are in, the buffer this step's
    # rows are kept in, or -1: commit them)
    state_replay: torch.Tensor
    state_pending: torch.Tensor
    logits_indices: torch.Tensor  # [B] int64, rows whose logits are wanted (each request's last token)
    # Host copies: the kernels take grid sizes from query_start_loc_cpu; the torch reference ops walk requests one
    # by one with both. A captured decode graph has no host lengths (seq_lens_cpu None): only kernels run there.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int] | None
    # metadata derived from the above that every layer would otherwise rebuild (the first layer that needs an
    # entry makes it): e.g. fla's varlen offsets
    derived: dict = field(default_factory=dict, repr=False, compare=False)


def to_device(device, *arrays: torch.Tensor | np.ndarray) -> list[torch.Tensor]:
    """Host tensors or numpy arrays of one dtype -> device tensors of the same shapes, by one copy from pinned
    memory that does not wait for the device (a pageable copy would wait for every queued kernel first). The
    parts are written through numpy: a torch slice assignment costs several times more host time."""
    arrays = [np.asarray(a) for a in arrays]
    align = 16 // arrays[0].itemsize  # each part starts 16-byte aligned, as fresh tensors do (Triton
    starts, size = [], 0              # specialises kernels on pointer alignment)
    for a in arrays:
        starts.append(size)
        size += -(-a.size // align) * align
    dtype = torch.from_numpy(arrays[0][:0]).dtype
    flat = torch.empty(size, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    host = flat.numpy()
    for a, start in zip(arrays, starts):
        host[start : start + a.size] = a.reshape(-1)
    flat = flat.to(device, non_blocking=True)
    return [flat[start : start + a.size].view(a.shape) for a, start in zip(arrays, starts)]


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for a host list of rows, without waiting for the device: indexing by a Python list copies the
    index from pageable memory, which waits for every queued kernel first (three such waits a mixed step, each
    letting the device run dry while the host catches up: docs/BENCHMARKS.md, fourteenth session)."""
    idx, = to_device(x.device, np.asarray(rows, dtype=np.int64))
    return x.index_select(0, idx)

