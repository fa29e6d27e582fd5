"""Prefill-only engine -> state tensors -> decode engine gives the colocated engine's output, in one process.

The oracle is the colocated `LLM` (itself pinned to HF transformers); the state moves as plain tensors, so this
isolates the engine side of the hand-off from the transports and servers.
"""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.model.presets import preset_config, random_model

LENGTHS, MAX_NEW = [3, 20, 7, 33, 12, 5, 1, 26], [10, 20, 5, 15, 8, 12, 1, 4]


def disaggregated(name, k, params, prompts, block_size=4):
    cfg = preset_config(name)
    model = random_model(cfg, "cpu", torch.float32)
    ecfg = dict(block_size=block_size, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=16,
                num_speculative_tokens=k)
    prefill = Engine(cfg, model, EngineConfig(**ecfg), prefill_only=True)
    decode = Engine(cfg, model, EngineConfig(**ecfg))
    outputs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = str(i)
        lease = decode.reserve(rid, p, sp)
        assert lease is not None
        prefill.add_request(rid, p, sp)
        while True:
            done = prefill.step()
            if done:  # the first token ended it: nothing to hand off
                outputs[rid] = done[0].output_token_ids
                decode.abort(rid)
                break
            handed = prefill.take_prefilled()
            if handed:
                (h,) = handed
                decode.install_prefilled(lease, h.seq.output_token_ids[0], None, h.seq.drafts, dict(h.state),
                                         h.rng_state)
                break
        # several requests decode together while later ones are still being prefilled
        if i % 3 == 2 or i == len(prompts) - 1:
            pending = {s.request_id: s for s in decode.scheduler.running}
            while decode.has_work():
                decode.step()
            outputs.update({rid: s.output_token_ids for rid, s in pending.items()})
    for eng in (prefill, decode):
        assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0
        assert not eng.sequences and not eng.generators
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("seeded", [False, True])
def test_prefill_then_decode_equals_colocated(k, seeded):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
    if seeded:  # a seeded stochastic request continues its random stream on the decode worker
        params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.95, seed=10 + i, ignore_eos=True)
                  for i, m in enumerate(MAX_NEW)]
    else:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_NEW]
    llm = LLM(model="tiny-moe", max_num_seqs=3, max_num_batched_tokens=16, block_size=4, max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert disaggregated("tiny-moe", k, params, prompts) == want


def test_reserve_refuses_when_full_and_frees_on_abort():
    cfg = preset_config("tiny-moe")
    eng = Engine(cfg, random_model(cfg, "cpu", torch.float32),
                 EngineConfig(block_size=4, max_model_len=64, max_num_seqs=2, num_speculative_tokens=2))
    sp = SamplingParams(max_tokens=8)
    assert eng.reserve("a", [3, 4, 5], sp) is not None and eng.reserve("b", [3, 4], sp) is not None
    assert eng.reserve("c", [3], sp) is None  # max_num_seqs counts leases
    with pytest.raises(ValueError):
        eng.reserve("d", [3] * 60, sp)  # can never fit max_model_len
    eng.abort("a")
    eng.abort("b")
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0 and not eng.sequences
