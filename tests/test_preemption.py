"""Blocks allocated as requests grow, and preemption: a pool that holds about a quarter of a workload serves all
of it, each request exactly as the same engine with a pool large enough for everything serves it."""

import pytest
import torch

from tandem.config import ConfigError, EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.model.presets import preset_config, random_model

CFG = preset_config("tiny-moe")
MODEL = random_model(CFG, "cpu", torch.float32)
BLOCK, MAX_LEN, K = 4, 64, 2


def engine(**kw) -> Engine:
    kw = {"max_num_seqs": 16, "max_num_batched_tokens": 32, "num_speculative_tokens": K, **kw}
    return Engine(CFG, MODEL, EngineConfig(block_size=BLOCK, max_model_len=MAX_LEN, **kw))


def serve(eng: Engine, prompts, params):
    """Every request's (tokens, logprobs, finish reason); the largest number running at once."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    seqs = [eng.sequences[str(i)] for i in range(len(prompts))]
    most = 0
    while eng.has_work():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0
    assert not eng.sequences and not eng.generators
    return [(s.output_token_ids, s.output_logprobs, s.finish_reason) for s in seqs], most


def workload(n=16):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 24, (n,), generator=g).tolist()
    prompts = [torch.randint(2, CFG.vocab_size, (m,), generator=g).tolist() for m in lengths]
    new = torch.randint(6, 20, (n,), generator=g).tolist()
    return prompts, new


def blocks_for_quarter(prompts, new) -> int:
    tokens = sum(len(p) + m + K for p, m in zip(prompts, new))
    blocks = -(-tokens // (4 * BLOCK)) + 1
    assert blocks >= MAX_LEN // BLOCK + 1  # the pool must still hold one max-length request
    return blocks


def assert_same(got, want):
    for (toks, lps, why), (toks_o, lps_o, why_o) in zip(got, want):
        assert toks == toks_o and why == why_o
        assert len(lps) == len(lps_o)
        for a, b in zip(lps, lps_o):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("stochastic", [False, True])
def test_small_pool_preempts_and_changes_no_output(stochastic):
    prompts, new = workload()
    if stochastic:
        params = [SamplingParams(max_tokens=m, temperature=1.0, seed=100 + i, logprobs=2, ignore_eos=True)
                  for i, m in enumerate(new)]
    else:  # penalties and min_tokens see the history: a recomputed request's outputs must stay outputs
        params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=1 if i % 2 else None, min_tokens=m // 2,
                                 repetition_penalty=1.3 if i % 3 == 0 else 1.0,
                                 frequency_penalty=0.5 if i % 3 == 1 else 0.0)
                  for i, m in enumerate(new)]
    want, _ = serve(engine(), prompts, params)
    small = engine(num_kv_blocks=blocks_for_quarter(prompts, new))
    got, _ = serve(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert_same(got, want)


def test_nothing_reserves_max_tokens():
    """A pool of two max-length requests runs eight that may each reach max_model_len but stop early."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, CFG.vocab_size, (10,), generator=g).tolist() for _ in range(8)]
    short = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 8
    want, _ = serve(engine(), prompts, short)
    # each stops at its sixth token (or earlier, where that token came before)
    params = [SamplingParams(max_tokens=MAX_LEN - 10 - K, temperature=0.0, stop_token_ids=[w[0][-1]])
              for w in want]
    got, most = serve(engine(num_kv_blocks=2 * MAX_LEN // BLOCK + 1), prompts, params)
    assert most == 8
    for (toks, _, why), (toks_o, _, _) in zip(got, want):
        assert why == "stop" and toks == toks_o[: len(toks)]


def test_a_pool_too_small_for_one_request_refuses_to_start():
    with pytest.raises(ConfigError, match=r"largest max_model_len that fits is 60\b"):
        engine(num_kv_blocks=MAX_LEN // BLOCK)  # one block short (block 0 is the null block)
