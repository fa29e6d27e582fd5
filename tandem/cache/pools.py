"""Device memory for the caches: a paged KV pool per full-attention layer and a GDN state slot pool per GDN layer.

- KV: K and V each `[num_blocks, block_size, kv_heads, head_dim]`; block 0 is the null block. The MTP layer, when
  the model has one, gets its own pair (`mtp_cache`) indexed by the same block tables.
- GDN: conv state `[slots, conv_dim, K-1]` in the model dtype and recurrent state `[slots, nv, dk, dv]` in the
  config's ssm dtype (fp32 for Qwen3.5), one slot a request; slot 0 is the null slot. A slot is zeroed when handed
  out, so a new request always starts from the empty state (or from a prefix-cache snapshot's copy). Each slot
  also owns two pending buffers (rows 2 * slot and 2 * slot + 1 of `[2 * slots, k+1, width]` in the model dtype,
  `tandem/ops/gdn.py`): a verify step's rows wait there until the next step knows which were accepted. Nothing
  reads them before they are written.
- Prefix-cache snapshots (`tandem/cache/prefix.py`): conv and recurrent states of every GDN layer,
  `[layers, snapshots + 1, ...]` (entry 0 unused), copied from a slot after the prompt chunk that ends at a
  snapshot boundary, and into a new request's slot on a hit.

Under tensor parallelism each rank's pools hold its own heads only (KV heads, GDN key/value heads and their conv
channels); block and slot numbers are the same on every rank, handed out by rank 0's allocators.
"""

from __future__ import annotations

import math

import torch

from tandem.cache.allocator import CountingAllocator
from tandem.cache.prefix import BlockPool
from tandem.config import EngineConfig, ModelConfig
from tandem.batch import to_device
from tandem.ops.gdn import pending_width
from tandem.parallel import SINGLE, TPGroup


class CachePools:
    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool = False, tp: TPGroup = SINGLE):
        dev, dt = ecfg.device, ecfg.dtype
        self.tp = tp
        self.blocks = BlockPool(ecfg.num_kv_blocks)
        self.slots = CountingAllocator(ecfg.num_state_slots + 1, "gdn state slots")
        n = tp.world_size
        kv_shape = (ecfg.num_kv_blocks, ecfg.block_size, cfg.num_kv_heads // n, cfg.head_dim)
        conv_shape = (ecfg.num_state_slots + 1, cfg.conv_dim // n, cfg.conv_kernel - 1)
        rec_shape = (ecfg.num_state_slots + 1, cfg.gdn_num_v_heads // n, cfg.gdn_k_dim, cfg.gdn_v_dim)
        pending_shape = (2 * (ecfg.num_state_slots + 1), 1 + ecfg.num_speculative_tokens,
                         pending_width(cfg.conv_dim // n, cfg.gdn_num_k_heads // n, cfg.gdn_k_dim,
                                       cfg.gdn_num_v_heads // n, cfg.gdn_v_dim))
        ssm_dtype = cfg.ssm_dtype or dt
        # every GDN layer's conv and recurrent states are parts of one tensor each, so handing out slots zeroes
        # them by two launches, not two per layer (120 a request on the 35B-A3B, while the device waits)
        n_gdn = cfg.layer_types.count("linear_attention")
        self._conv = _stacked(n_gdn, conv_shape, dt, dev)
        self._rec = _stacked(n_gdn, rec_shape, ssm_dtype, dev)
        # (K, V) of an attention layer, (conv state, recurrent state, pending buffers) of a GDN layer
        self.layer_caches: list[tuple[torch.Tensor, ...]] = []
        gdn = iter(range(n_gdn))
        for t in cfg.layer_types:
            if t == "full_attention":
                cache = (torch.zeros(kv_shape, dtype=dt, device=dev), torch.zeros(kv_shape, dtype=dt, device=dev))
            else:
                i = next(gdn)
                cache = (self._conv[i], self._rec[i], torch.empty(pending_shape, dtype=dt, device=dev))
            self.layer_caches.append(cache)
        self.mtp_cache = (torch.zeros(kv_shape, dtype=dt, device=dev),
                          torch.zeros(kv_shape, dtype=dt, device=dev)) if with_mtp else None
        snaps = ecfg.num_state_snapshots + 1 if ecfg.num_state_snapshots else 0
        self._snap_conv = torch.zeros((n_gdn, snaps, *conv_shape[1:]), dtype=dt, device=dev)
        self._snap_rec = torch.zeros((n_gdn, snaps, *rec_shape[1:]), dtype=ssm_dtype, device=dev)

    def save_snapshot(self, slot: int, entry: int) -> None:
        """Every GDN layer's state in `slot` into snapshot `entry` (queued after the step that wrote it)."""
        self._snap_conv[:, entry].copy_(self._conv[:, slot])
        self._snap_rec[:, entry].copy_(self._rec[:, slot])

    def load_snapshot(self, entry: int, slot: int) -> None:
        """Snapshot `entry` into `slot`: a request starts from the cached prefix's state."""
        self._conv[:, slot].copy_(self._snap_conv[:, entry])
        self._rec[:, slot].copy_(self._snap_rec[:, entry])

    def allocate_slots(self, n: int) -> list[int]:
        slots = self.slots.allocate(n)
        self.zero_slots(slots)
        return slots

    def zero_slots(self, slots: list[int]) -> None:
        if not slots or not self._conv.shape[0]:
            return
        idx, = to_device(self._conv.device, torch.tensor(slots))
        self._conv.index_fill_(1, idx, 0)
        self._rec.index_fill_(1, idx, 0)


def _stacked(n: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros [n, *shape] whose n parts each start 16-byte aligned, as separate allocations do: Triton specialises
    its kernels on pointer alignment, so a misaligned layer would compile variants of its own."""
    align = 16 // dtype.itemsize
    part = -(-math.prod(shape) // align) * align
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return torch.zeros(n * part, dtype=dtype, device=device).as_strided((n, *shape), (part, *strides))
