"""Caches sized from a memory budget (kv_cache_memory_bytes): the pools' tensors fill it, slots bound the running
requests, and a budget that cannot hold one max-length request is refused with what it has and needs."""

import logging

import pytest
import torch

from tandem.config import ConfigError, EngineConfig
from tandem.engine.engine import Engine
from tandem.model.presets import preset_config, random_model

CFG = preset_config("tiny-moe")
MODEL = random_model(CFG, "cpu", torch.float32)


def pool_bytes(eng: Engine) -> int:
    """Every byte the pools' tensors hold, counted from the tensors themselves."""
    seen, total = set(), 0
    tensors = [t for cache in eng.pools.layer_caches for t in cache] + list(eng.pools.mtp_cache or ()) + \
        [eng.pools._snap_conv, eng.pools._snap_rec]
    for t in tensors:
        base = t.untyped_storage()
        if base.data_ptr() not in seen:
            seen.add(base.data_ptr())
            total += base.nbytes()
    return total


def engine(**kw) -> Engine:
    kw = {"block_size": 4, "max_model_len": 64, "num_speculative_tokens": 2, **kw}
    return Engine(CFG, MODEL, EngineConfig(**kw))


def per_block_and_slot() -> tuple[int, int]:
    """A block's and a slot's bytes, from two pools that differ by one block, and by one slot."""
    a = pool_bytes(engine(num_kv_blocks=20, num_state_slots=4))
    b = pool_bytes(engine(num_kv_blocks=21, num_state_slots=4))
    c = pool_bytes(engine(num_kv_blocks=20, num_state_slots=5))
    return b - a, c - a


def per_snapshot() -> int:
    a = pool_bytes(engine(num_kv_blocks=20, num_state_slots=4, num_state_snapshots=4))
    return pool_bytes(engine(num_kv_blocks=20, num_state_slots=4, num_state_snapshots=5)) - a


def test_budget_fills_slots_first_then_blocks(caplog):
    blk, slot = per_block_and_slot()
    per_request = slot + 16 * blk  # a slot and one 64-token (max_model_len) request's blocks
    budget = 7 * per_request + slot + 3 * blk + blk // 2  # seven slots' worth with their blocks, and change
    with caplog.at_level(logging.INFO, logger="tandem.cache.sizing"):
        eng = engine(max_num_seqs=6, kv_cache_memory_bytes=budget, enable_prefix_caching=False)
    # six slots (+ the null slot) as max_num_seqs asks, every other byte in blocks
    assert eng.ecfg.num_state_slots == 6 and eng.ecfg.max_num_seqs == 6
    assert eng.ecfg.num_kv_blocks == (budget - 7 * slot) // blk
    assert budget - blk < pool_bytes(eng) <= budget
    tokens = (eng.ecfg.num_kv_blocks - 1) * 4
    assert (f"KV cache: {tokens} tokens; state slots: 6; prefix-cache state snapshots: 0; maximum concurrency at "
            "max_model_len (64): ") in caplog.text


def test_each_slot_keeps_blocks_for_its_request(caplog):
    """A budget of 30 slots' bytes and max_num_seqs 64: the slots are only as many as fit each beside the blocks
    of a max_model_len (here shorter than KV_TOKENS_PER_SLOT) request, not 26 with the blocks of one."""
    blk, slot = per_block_and_slot()
    budget = 30 * slot
    with caplog.at_level(logging.WARNING, logger="tandem.cache.sizing"):
        eng = engine(max_num_seqs=64, kv_cache_memory_bytes=budget, enable_prefix_caching=False)
    slots = eng.ecfg.num_state_slots
    assert slots == budget // (slot + 16 * blk) - 1 and eng.ecfg.max_num_seqs == slots
    assert eng.ecfg.num_kv_blocks - 1 >= 16 * slots
    assert f"max_num_seqs lowered from 64 to {slots}" in caplog.text


def test_prefix_caching_gives_snapshots_a_tenth_of_what_the_slots_leave():
    blk, slot = per_block_and_slot()
    snap = per_snapshot()
    assert snap < slot  # a snapshot is a slot's states without its pending buffers
    budget = 7 * slot + 60 * snap + 100 * blk
    eng = engine(max_num_seqs=6, kv_cache_memory_bytes=budget)
    rest = budget - 7 * slot
    n = eng.ecfg.num_state_snapshots
    assert eng.ecfg.num_state_slots == 6 and (n + 1) * snap <= 0.1 * rest < (n + 2) * snap
    assert eng.ecfg.num_kv_blocks == (rest - (n + 1) * snap) // blk
    assert budget - blk < pool_bytes(eng) <= budget
    # no room beside one max-length request's blocks: no snapshots, and nothing is cached
    tight = engine(max_num_seqs=3, kv_cache_memory_bytes=17 * blk + 4 * slot)
    assert tight.ecfg.num_state_snapshots == 0 and tight.scheduler.prefix is None


def test_slots_are_capped_to_leave_one_max_length_request_its_blocks(caplog, monkeypatch):
    from tandem.cache import sizing

    monkeypatch.setattr(sizing, "KV_TOKENS_PER_SLOT", 4)  # slots of short requests, beside one long one
    blk, slot = per_block_and_slot()
    budget = 17 * blk + 4 * slot  # one 64-token request (16 blocks + the null block) and 3 slots + the null slot
    with caplog.at_level(logging.WARNING, logger="tandem.cache.sizing"):
        eng = engine(max_num_seqs=64, kv_cache_memory_bytes=budget)
    assert eng.ecfg.num_state_slots == 3 and eng.ecfg.max_num_seqs == 3 and eng.ecfg.num_kv_blocks == 17
    assert "max_num_seqs lowered from 64 to 3" in caplog.text
    assert pool_bytes(eng) == budget


def test_the_smallest_budget_serves_a_max_length_request():
    """A pool of exactly one max_model_len request's blocks starts it (admission's free-block watermark cannot
    hold it back on an idle pool), and it gives the large pool's tokens."""
    from tandem.engine.sampling_params import SamplingParams

    blk, slot = per_block_and_slot()
    prompt, params = list(range(3, 33)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # 30 + 30 + 2
    outs = []
    for eng in (engine(kv_cache_memory_bytes=17 * blk + 2 * slot), engine(num_kv_blocks=64)):
        eng.add_request("r", prompt, params)
        done = []
        for _ in range(200):  # bounded: a request that is never admitted would loop forever
            if not eng.has_work():
                break
            done += eng.step()
        outs.append([s.output_token_ids for s in done])
    assert len(outs[0]) == 1 and len(outs[0][0]) == 30 and outs[0] == outs[1]


def test_a_budget_below_one_max_length_request_is_refused():
    blk, slot = per_block_and_slot()
    budget = 16 * blk + 2 * slot  # one block short
    with pytest.raises(ConfigError, match=rf"has .*\({budget} bytes\).*needs .*\({budget + blk} bytes\).*"
                                          r"largest that fits is 60\b"):
        engine(kv_cache_memory_bytes=budget)


def test_serve_passes_the_cache_flags_to_workers_that_size_by_them():
    """`tandem serve --kv-cache-memory-bytes 3Mi` gives each worker that budget, resolved defaults included."""
    import argparse

    from tandem.launch import _engine_argv, add_args
    from tandem.worker_setup import add_engine_args, add_server_args, engine_config, resolve_engine_args

    serve = argparse.ArgumentParser()
    add_args(serve)
    args = serve.parse_args(["--model", "tiny-moe", "--device", "cpu", "--kv-cache-memory-bytes", "3Mi"])
    resolve_engine_args(args)
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    add_server_args(worker, 0)
    ecfg = engine_config(worker.parse_args(_engine_argv(args) + ["--device", "cpu"]))
    assert ecfg.kv_cache_memory_bytes == 3 << 20 and ecfg.dtype == torch.float32
    assert ecfg.max_model_len == 4096 and ecfg.max_num_seqs == 64 and ecfg.gpu_memory_utilization == 0.9
