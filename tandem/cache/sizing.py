"""How many KV blocks and GDN state slots the caches get, from a memory budget.

A KV block holds K and V of `block_size` tokens in every full-attention layer (and in the MTP layer, when the
model has one); a state slot holds every GDN layer's conv and recurrent states and its two pending buffers of
k + 1 rows. Under tensor parallelism these are one rank's heads, and the budget is one device's.

The split: state slots first, one per running request up to `max_num_seqs`, but never so many that the blocks
left cannot hold one `max_model_len` request; every remaining byte goes to KV blocks. Slots bound how many
requests run at once (`max_num_seqs` is lowered to them, with a log line); blocks bound how many tokens they
hold together. A budget that cannot hold one max-length request and one slot is refused, with what it has and
what it needs.
"""

from __future__ import annotations

import logging

from tandem.config import ConfigError, EngineConfig, ModelConfig
from tandem.ops.gdn import pending_width

log = logging.getLogger(__name__)
GIB = 1 << 30


def kv_block_bytes(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, tp_size: int = 1) -> int:
    layers = cfg.layer_types.count("full_attention") + (1 if with_mtp else 0)
    return layers * 2 * ecfg.block_size * (cfg.num_kv_heads // tp_size) * cfg.head_dim * ecfg.dtype.itemsize


def state_slot_bytes(cfg: ModelConfig, ecfg: EngineConfig, tp_size: int = 1) -> int:
    n = tp_size
    conv = cfg.conv_dim // n * (cfg.conv_kernel - 1) * ecfg.dtype.itemsize
    rec = cfg.gdn_num_v_heads // n * cfg.gdn_k_dim * cfg.gdn_v_dim * (cfg.ssm_dtype or ecfg.dtype).itemsize
    pending = 2 * (1 + ecfg.num_speculative_tokens) * ecfg.dtype.itemsize * pending_width(
        cfg.conv_dim // n, cfg.gdn_num_k_heads // n, cfg.gdn_k_dim, cfg.gdn_num_v_heads // n, cfg.gdn_v_dim)
    return cfg.layer_types.count("linear_attention") * (conv + rec + pending)


def cache_bytes(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, tp_size: int = 1) -> int:
    """What the pools of `ecfg`'s sizes take (null block and null slot included)."""
    return (ecfg.num_kv_blocks * kv_block_bytes(cfg, ecfg, with_mtp, tp_size)
            + (ecfg.num_state_slots + 1) * state_slot_bytes(cfg, ecfg, tp_size))


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
    slots = ecfg.num_state_slots or min(ecfg.max_num_seqs, (budget - min_blocks * blk) // slot - 1)
    if slots < ecfg.max_num_seqs:
        log.warning("max_num_seqs lowered from %d to %d: the state slots that fit beside one max_model_len "
                    "request's KV blocks", ecfg.max_num_seqs, slots)
        ecfg.max_num_seqs = slots
    ecfg.num_state_slots = slots
    ecfg.num_kv_blocks = (budget - (slots + 1) * slot) // blk
    ecfg.check_blocks(ecfg.num_kv_blocks)


def capacity(ecfg: EngineConfig) -> tuple[int, int, float]:
    """(KV tokens, state slots, requests of max_model_len that fit at once)."""
    tokens = (ecfg.num_kv_blocks - 1) * ecfg.block_size
    return tokens, ecfg.num_state_slots, min(ecfg.num_state_slots, (ecfg.num_kv_blocks - 1) / ecfg.blocks_per_seq)


def log_capacity(ecfg: EngineConfig, nbytes: int) -> None:
    tokens, slots, concurrency = capacity(ecfg)
    log.info("KV cache: %d tokens; state slots: %d; maximum concurrency at max_model_len (%d): %.2fx (%.2f GiB, "
             "%d blocks of %d tokens)", tokens, slots, ecfg.max_model_len, concurrency, nbytes / GIB,
             ecfg.num_kv_blocks, ecfg.block_size)
