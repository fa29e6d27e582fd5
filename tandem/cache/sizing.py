"""How many KV blocks and GDN state slots the caches get, from a memory budget.

A KV block holds K and V of `block_size` tokens in every full-attention layer (and in the MTP layer, when the
model has one); a state slot holds every GDN layer's conv and recurrent states and its two pending buffers of
k + 1 rows. Under tensor parallelism these are one rank's heads, and the budget is one device's.

The split: state slots first, one per running request up to `max_num_seqs`, as many as fit each beside the
blocks of KV_TOKENS_PER_SLOT tokens (or of max_model_len, when shorter), and never so many that the blocks left
cannot hold one `max_model_len` request; every remaining byte goes to KV blocks. Slots bound how many requests
run at once (`max_num_seqs` is lowered to them, with a log line); blocks bound how many tokens they hold
together. A budget that cannot hold one max-length request and one slot is refused, with what it has and
what it needs.

With prefix caching on, GDN state snapshots (every GDN layer's conv and recurrent state, without pending
buffers) take PREFIX_STATE_SHARE of what is left after the slots, as long as the blocks left still hold one
max_model_len request; the rest goes to KV blocks, which cached prefixes share.
"""

from __future__ import annotations

import logging

from tandem.config import ConfigError, EngineConfig, ModelConfig
from tandem.ops.gdn import pending_width

log = logging.getLogger(__name__)
GIB = 1 << 30
PREFIX_STATE_SHARE = 0.1  # of the budget after the state slots, for prefix-cache state snapshots
# a slot is worth its bytes only beside blocks for its request: on the 35B-A3B a slot (~66 MB) outweighs the KV
# of 2048 tokens (~46 MB), and slots alone could take a small budget whole
KV_TOKENS_PER_SLOT = 2048


def kv_block_bytes(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, tp_size: int = 1) -> int:
    layers = cfg.layer_types.count("full_attention") + (1 if with_mtp else 0)
    return layers * 2 * ecfg.block_size * (cfg.num_kv_heads // tp_size) * cfg.head_dim * ecfg.dtype.itemsize


def snapshot_bytes(cfg: ModelConfig, ecfg: EngineConfig, tp_size: int = 1) -> int:
    """One prefix-cache snapshot: every GDN layer's conv and recurrent state."""
    n = tp_size
    conv = cfg.conv_dim // n * (cfg.conv_kernel - 1) * ecfg.dtype.itemsize
    rec = cfg.gdn_num_v_heads // n * cfg.gdn_k_dim * cfg.gdn_v_dim * (cfg.ssm_dtype or ecfg.dtype).itemsize
    return cfg.layer_types.count("linear_attention") * (conv + rec)


def state_slot_bytes(cfg: ModelConfig, ecfg: EngineConfig, tp_size: int = 1) -> int:
    """One running request's slot: a snapshot's states and two pending buffers of k + 1 rows per GDN layer."""
    n = tp_size
    pending = 2 * (1 + ecfg.num_speculative_tokens) * ecfg.dtype.itemsize * pending_width(
        cfg.conv_dim // n, cfg.gdn_num_k_heads // n, cfg.gdn_k_dim, cfg.gdn_num_v_heads // n, cfg.gdn_v_dim)
    return snapshot_bytes(cfg, ecfg, tp_size) + cfg.layer_types.count("linear_attention") * pending


def cache_bytes(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, tp_size: int = 1) -> int:
    """What the pools of `ecfg`'s sizes take (null block, null slot and unused snapshot entry 0 included)."""
    snapshots = ecfg.num_state_snapshots + 1 if ecfg.num_state_snapshots else 0
    return (ecfg.num_kv_blocks * kv_block_bytes(cfg, ecfg, with_mtp, tp_size)
            + (ecfg.num_state_slots + 1) * state_slot_bytes(cfg, ecfg, tp_size)
            + snapshots * snapshot_bytes(cfg, ecfg, tp_size))


def slots_that_fit(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, budget: int, tp_size: int = 1) -> int:
    """The state slots `budget` bytes hold (module docstring): each beside the blocks of KV_TOKENS_PER_SLOT tokens
    (max_model_len when shorter), and never so many that the blocks left cannot hold one max_model_len request;
    one slot whenever that request fits."""
    blk, slot = kv_block_bytes(cfg, ecfg, with_mtp, tp_size), state_slot_bytes(cfg, ecfg, tp_size)
    beside_one = (budget - (ecfg.blocks_per_seq + 1) * blk) // slot - 1  # - the null slot
    with_blocks = budget // (slot + -(-min(KV_TOKENS_PER_SLOT, ecfg.max_model_len) // ecfg.block_size) * blk) - 1
    return min(beside_one, max(1, with_blocks))


def size_caches(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, budget: int, tp_size: int = 1) -> None:
    """Sets ecfg.num_kv_blocks and ecfg.num_state_slots from `budget` bytes (module docstring), and lowers
    max_num_seqs to the slots when fewer fit."""
    blk, slot = kv_block_bytes(cfg, ecfg, with_mtp, tp_size), state_slot_bytes(cfg, ecfg, tp_size)
    min_blocks = ecfg.blocks_per_seq + 1  # + the null block
    need = min_blocks * blk + 2 * slot  # one slot + the null slot
    if budget < need:
        fits = max(0, ((budget - 2 * slot) // blk - 1) * ecfg.block_size)
        raise ConfigError(f"the KV cache has {budget / GIB:.2f} GiB ({budget} bytes); one max_model_len "
                          f"({ecfg.max_model_len}) request needs {need / GIB:.2f} GiB ({need} bytes): give it more "
                          f"memory, or lower max_model_len (the largest that fits is {fits})")
    slots = ecfg.num_state_slots or min(ecfg.max_num_seqs, slots_that_fit(cfg, ecfg, with_mtp, budget, tp_size))
    if slots < ecfg.max_num_seqs:
        log.warning("max_num_seqs lowered from %d to %d: the state slots that fit beside their requests' KV "
                    "blocks (tandem/cache/sizing.py)", ecfg.max_num_seqs, slots)
        ecfg.max_num_seqs = slots
    ecfg.num_state_slots = slots
    rest = budget - (slots + 1) * slot
    if ecfg.num_state_snapshots is None:  # prefix caching on, snapshots not given
        snap = snapshot_bytes(cfg, ecfg, tp_size)
        ecfg.num_state_snapshots = max(0, min(int(PREFIX_STATE_SHARE * rest), rest - min_blocks * blk) // snap - 1)
    if ecfg.num_state_snapshots:
        rest -= (ecfg.num_state_snapshots + 1) * snapshot_bytes(cfg, ecfg, tp_size)
    ecfg.num_kv_blocks = rest // blk
    ecfg.check_blocks(ecfg.num_kv_blocks)


def capacity(ecfg: EngineConfig) -> tuple[int, int, float]:
    """(KV tokens, state slots, requests of max_model_len that fit at once)."""
    tokens = (ecfg.num_kv_blocks - 1) * ecfg.block_size
    return tokens, ecfg.num_state_slots, min(ecfg.num_state_slots, (ecfg.num_kv_blocks - 1) / ecfg.blocks_per_seq)


def log_capacity(ecfg: EngineConfig, nbytes: int) -> None:
    tokens, slots, concurrency = capacity(ecfg)
    log.info("KV cache: %d tokens; state slots: %d; prefix-cache state snapshots: %d; maximum concurrency at "
             "max_model_len (%d): %.2fx (%.2f GiB, %d blocks of %d tokens)", tokens, slots,
             ecfg.num_state_snapshots or 0, ecfg.max_model_len, concurrency, nbytes / GIB, ecfg.num_kv_blocks,
             ecfg.block_size)
