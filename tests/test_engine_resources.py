"""Allocator accounting: every block and slot comes back, however a request ends."""

import torch

from tandem.cache.allocator import CountingAllocator
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Status
from tandem.model.presets import preset_config, random_model

import pytest


def engine(**kw):
    cfg = preset_config("tiny-moe")
    kw = {"max_model_len": 64, **kw}
    return Engine(cfg, random_model(cfg, "cpu", torch.float32), EngineConfig(block_size=4, **kw))


def test_counts_return_to_zero_with_aborts_at_every_stage():
    eng = engine(max_num_seqs=3, max_num_batched_tokens=8)
    for i in range(7):
        eng.add_request(f"r{i}", list(range(2, 2 + 5 + 3 * i)), SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()  # r0 prefilled, r1 mid-prefill
    assert eng.sequences["r1"].in_prefill and eng.sequences["r6"].status == Status.WAITING
    eng.abort("r1")  # mid-prefill
    eng.abort("r6")  # still waiting
    for _ in range(3):
        eng.step()
    eng.abort("r0")  # decoding
    eng.abort("missing")  # unknown ids are ignored
    while eng.has_work():
        eng.step()
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0
    assert not eng.sequences and not eng.generators


def test_engine_refuses_a_model_of_another_dtype():
    """The caches follow the engine config's dtype; a model in another one would reach kernels that cannot mix
    them (on the GPU the attention kernel fails to compile), so the engine says so when it is built."""
    cfg = preset_config("tiny-moe")
    with pytest.raises(ValueError, match="bfloat16.*float32"):
        Engine(cfg, random_model(cfg, "cpu", torch.bfloat16), EngineConfig(block_size=4, max_model_len=64))


def test_requests_grow_into_the_pool_and_the_newest_is_preempted():
    # 9 usable blocks of 4 tokens; two requests of 20 tokens (5 blocks each) both start, as nothing reserves
    # max_tokens, and the newer one is preempted when the older one needs its blocks
    eng = engine(max_num_seqs=4, num_kv_blocks=10, max_model_len=36)
    for i in range(2):
        eng.add_request(f"r{i}", list(range(2, 12)), SamplingParams(max_tokens=10, ignore_eos=True))
    eng.step()
    assert len(eng.scheduler.running) == 2 and not eng.scheduler.waiting
    done = []
    while eng.has_work():
        done += eng.step()
    assert [s.request_id for s in done] == ["r0", "r1"] and all(len(s.output_token_ids) == 10 for s in done)
    assert eng.scheduler.num_preemptions >= 1 and done[1].num_preemptions >= 1 and done[0].num_preemptions == 0
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0


def test_allocator_rejects_double_free():
    a = CountingAllocator(4, "x")
    ids = a.allocate(2)
    a.free(ids)
    with pytest.raises(ValueError):
        a.free(ids[:1])
    assert a.num_used == 0 and a.num_free == 3


@pytest.mark.parametrize("prefill_only", [False, True])
@pytest.mark.parametrize("max_model_len", [64, 12])  # 12: the longest warm-up prompt (8) is under the budget
def test_warm_up_frees_everything_and_changes_no_output(prefill_only, max_model_len):
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32)
    ecfg = EngineConfig(block_size=4, max_model_len=max_model_len, max_num_seqs=3, max_num_batched_tokens=16,
                        num_speculative_tokens=2)

    def first_tokens(warm):
        eng = Engine(cfg, model, ecfg, prefill_only=prefill_only)
        if warm:
            prompt_rows = []
            step = eng.step
            eng.step = lambda: (step(), prompt_rows.append(eng.last_step.prompt_tokens))[0]
            eng.warm_up()
            del eng.step
            assert max(prompt_rows) == 16  # a step of the whole budget, of several prompts when they must be

            assert not eng.sequences and not eng.scheduler.running and not eng.scheduler.waiting
            assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0
        eng.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        seq = eng.sequences["a"]
        while seq.in_prefill or not seq.output_token_ids:
            eng.step()
        return seq.output_token_ids, seq.drafts

    assert first_tokens(True) == first_tokens(False)


def test_handed_out_slots_start_empty_in_every_gdn_layer():
    """The GDN layers' states are parts of two shared tensors (one launch each zeroes a slot everywhere): a slot
    handed out is zero in every layer, every other slot keeps its contents, and each layer's state is its own
    memory, 16-byte aligned as a separate allocation would be."""
    eng = engine(max_num_seqs=4)
    gdn = [c for c, t in zip(eng.pools.layer_caches, eng.cfg.layer_types) if t == "linear_attention"]
    assert len(gdn) >= 2
    for i, (conv, rec, _) in enumerate(gdn):
        conv.fill_(i + 1)
        rec.fill_(-(i + 1))
    slot, = eng.pools.allocate_slots(1)
    for i, (conv, rec, _) in enumerate(gdn):
        assert conv.data_ptr() % 16 == 0 and rec.data_ptr() % 16 == 0 and conv.is_contiguous()
        assert not conv[slot].any() and not rec[slot].any()
        others = [s for s in range(conv.shape[0]) if s != slot]
        assert (conv[others] == i + 1).all() and (rec[others] == -(i + 1)).all()
