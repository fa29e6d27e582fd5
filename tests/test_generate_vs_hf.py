"""Greedy generation through the continuous-batching engine equals HF `generate`, token for token."""

import pytest
import torch

from tandem import LLM, SamplingParams


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_greedy_matches_hf_generate(hf_checkpoints, kind):
    hf, path = hf_checkpoints[kind]
    g = torch.Generator().manual_seed(7)
    lengths = [3, 11, 1, 25, 6, 17, 40, 9]
    max_new = [5, 12, 8, 3, 10, 6, 4, 9]  # requests finish at different steps and new ones join
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]
    # small budgets force chunked prefill and staggered admission (3 running at a time)
    llm = LLM(model=path, max_num_seqs=3, max_num_batched_tokens=12, block_size=4, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new])
    for p, m, out in zip(prompts, max_new, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.pools.blocks.num_used == 0 and llm.engine.pools.slots.num_used == 0
