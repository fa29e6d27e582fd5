"""Sampling: seeded reproducibility independent of the batch, parameter validation, distributions and
penalties against independent computations."""

import math

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.sampler import apply_penalties, sample
from tandem.engine.sequence import Sequence


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-moe", max_num_seqs=8, max_model_len=256, block_size=4)


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = {"prompt_token_ids": [5, 6, 7, 8]}
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([p], sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (2, 9, 17)]
    mixed = llm.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(max_tokens=8, temperature=1.0)] * 2 + [sp] + [SamplingParams(max_tokens=5)])
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = llm.generate([p], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -5}, {"min_p": 2.0}, {"max_tokens": 0},
    {"repetition_penalty": 0.0}, {"presence_penalty": 3.0}, {"logprobs": -1}, {"min_tokens": 99},
])
def test_bad_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_request_changes_no_state(llm):
    before = (llm.engine.pools.blocks.num_used, len(llm.engine.sequences))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1] * 250}], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [10**6]}])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])
    assert (llm.engine.pools.blocks.num_used, len(llm.engine.sequences)) == before
    assert not llm.engine.has_work()


def seqs_with(params_list):
    return [Sequence(str(i), [1], p) for i, p in enumerate(params_list)]


def empirical(logits, params, n=6000):
    seqs = seqs_with([params] * n)
    toks, _ = sample(logits.expand(n, -1).clone(), seqs, {})
    return torch.bincount(toks, minlength=logits.shape[1]).double() / n


def test_distribution_temperature_top_k_top_p_min_p():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    n = 6000
    bound = 4.5 / math.sqrt(n)  # > 4 standard deviations of a frequency (sd <= 0.5 / sqrt(n))
    cases = [
        (SamplingParams(temperature=0.7), (logits / 0.7).softmax(-1)[0]),
        (SamplingParams(temperature=1.0, top_k=2), torch.tensor([2.0, 1.5]).softmax(0)),
        (SamplingParams(temperature=1.0, top_p=0.6), None),
        (SamplingParams(temperature=1.0, min_p=0.3), None),
    ]
    p = logits.softmax(-1)[0].double()
    for params, expected in cases:
        if params.top_p < 1:
            keep = (p.cumsum(0) - p) < params.top_p
        elif params.min_p > 0:
            keep = p >= params.min_p * p.max()
        else:
            keep = None
        if keep is not None:
            expected = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
        expected = torch.nn.functional.pad(expected.double(), (0, 6 - expected.numel()))
        freq = empirical(logits, params, n)
        assert (freq - expected).abs().max() < bound, (params, freq, expected)


def test_penalties_against_hf_processor_and_openai_formula():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.0]])
    s = Sequence("a", [0, 1], SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0,
                                              frequency_penalty=0.5))
    s.output_token_ids = [3, 3]
    expect = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([s.token_ids]), logits.clone())
    expect[0, 3] -= 0.5 * 2 + 1.0  # OpenAI: frequency * count + presence * (count > 0), output tokens only
    got = logits.clone()
    apply_penalties(got, [s])
    assert torch.allclose(got, expect)


def test_min_tokens_blocks_eos_and_logprobs_are_model_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    s = Sequence("a", [2], SamplingParams(temperature=0.0, min_tokens=1, logprobs=2), eos_ids=[0])
    tok, lps = sample(logits, [s], {})
    assert tok.item() == 1
    ref = logits.log_softmax(-1)[0]
    assert set(lps[0]) == {0, 1}
    assert abs(lps[0][0] - ref[0].item()) < 1e-6 and abs(lps[0][1] - ref[1].item()) < 1e-6


def test_stop_token_and_eos_finish(llm):
    # greedy first token of this prompt becomes a stop token: generation must end right there
    p = {"prompt_token_ids": [9, 8, 7]}
    first = llm.generate([p], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0]
    out = llm.generate([p], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[first.token_ids[1]],
                                           ignore_eos=True))[0].outputs[0]
    assert out.token_ids == first.token_ids[:2] and out.finish_reason == "stop"
