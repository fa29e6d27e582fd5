"""MTP speculative decoding: greedy outputs independent of k, per-position GDN states, lossless stochastic
verification, resource accounting."""

import random

import pytest
import torch

import tandem.engine.engine as engine_module
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.scheduler import ScheduledChunk
from tandem.engine.sequence import Sequence
from tandem.model.presets import preset_config, random_model

LENGTHS, MAX_NEW = [3, 20, 7, 33, 12, 5, 1, 26], [10, 20, 5, 15, 8, 12, 9, 4]


def run(name, k, monkeypatch=None, oracle=None, corrupt=0.0):
    llm = LLM(model=name, max_num_seqs=3, max_num_batched_tokens=16, block_size=4, max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
    if oracle is not None:
        # Drafts from the k=0 continuation, corrupted at random: exercises every acceptance length. The real
        # drafter still runs first, so the MTP cache is maintained exactly as in production.
        rng, real = random.Random(1), engine_module.draft

        def oracle_draft(model, runner, pools, items, hidden, drafting, kk):
            out = real(model, runner, pools, items, hidden, drafting, kk)
            for (seq, _, _), d in zip(items, out):
                if d:
                    ref = oracle[tuple(seq.prompt_token_ids)][len(seq.output_token_ids):]
                    d[:] = [t if i < len(ref) and rng.random() > corrupt else (t + 1) % 512
                            for i, t in enumerate((ref + d)[:kk])]
            return out

        monkeypatch.setattr(engine_module, "draft", oracle_draft)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_NEW])
    assert llm.engine.pools.blocks.num_used == 0 and llm.engine.pools.slots.num_used == 0
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}, llm.engine.spec_stats


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_greedy_identical_for_every_k(name, monkeypatch):
    base, _ = run(name, 0)
    for k in (1, 2, 3, 4):
        real, _ = run(name, k)  # the model's own MTP drafts
        assert real == base
        with monkeypatch.context() as m:
            forced, stats = run(name, k, m, oracle=base, corrupt=0.3)
        assert forced == base
        assert all(n > 0 for n in stats.accepted_per_position), stats  # every position was accepted sometimes
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # and rejected sometimes


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_states_equal_token_by_token(k):
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32, seed=1)
    ecfg = EngineConfig(block_size=4, max_num_seqs=2, max_model_len=64, num_speculative_tokens=k)
    tokens = torch.randint(2, 512, (9 + k + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    prompt, verify = tokens[:9], tokens[9:]
    for j in range(k + 1):  # the step "accepts" j drafts
        eng = Engine(cfg, model, ecfg)
        a, b = (Sequence(n, list(prompt), SamplingParams(max_tokens=8)) for n in "ab")
        for s in (a, b):
            eng.scheduler.add(s)
            eng.scheduler.waiting.popleft()
            assert eng.scheduler._allocate(s, 9 + 8)  # blocks for its whole length: the steps below run by hand
        eng.runner.run([ScheduledChunk(a, 9), ScheduledChunk(b, 9)])
        a.output_token_ids, a.drafts = verify[:1], verify[1:]
        eng.runner.run([ScheduledChunk(a, k + 1)])  # a verify step: its rows stay pending in the GDN layers
        a.kept(j + 1)  # the last token's row and j drafts accepted
        a.num_computed = 9 + j + 1
        a.output_token_ids, a.drafts = verify[: j + 1] + verify[:1], []  # then any next token
        eng.runner.run([ScheduledChunk(a, 1)])  # replays them: its slot holds the state after them
        b.prompt_token_ids += verify[: j + 1]
        for _ in range(j + 1):
            eng.runner.run([ScheduledChunk(b, 1)])
        for layer in cfg.gdn_layers:
            conv, rec, _ = eng.pools.layer_caches[layer]
            sa, sb = a.state_slots[0], b.state_slots[0]
            assert torch.allclose(conv[sa], conv[sb], atol=1e-6)
            assert torch.allclose(rec[sa], rec[sb], atol=1e-6)


def test_stochastic_verification_is_lossless(monkeypatch):
    """Sampled (top-k 3) pairs of first two tokens have the same distribution with k = 2 and drafts from a
    deliberately different, fixed distribution as with no speculation (two-sample bound, > 4 sd per cell)."""
    n, prompt = 1200, [5, 9, 2, 7]
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, seed=i) for i in range(n)]

    def pair_freqs(k):
        llm = LLM(model="tiny-moe", max_num_seqs=256, max_num_batched_tokens=1024, block_size=4, max_model_len=32,
                  speculative_config={"num_speculative_tokens": k} if k else None)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params if not k else
                            [SamplingParams(**{**p.__dict__, "seed": p.seed + n}) for p in params])
        pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
        return {q: pairs.count(q) / n for q in set(pairs)}, llm.engine.spec_stats

    base, _ = pair_freqs(0)
    top = max(base, key=base.get)
    with monkeypatch.context() as m:
        real = engine_module.draft

        def fixed_draft(*args):
            return [[top[1], top[0]] if d else d for d in real(*args)]

        m.setattr(engine_module, "draft", fixed_draft)
        spec, stats = pair_freqs(2)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for q in set(base) | set(spec):
        assert abs(base.get(q, 0) - spec.get(q, 0)) < 4 * (2 * 0.25 / n) ** 0.5, q


@pytest.mark.parametrize("cuda_graphs", [False, True])  # True: acceptance decided on the device (graphs.py)
def test_emulated_acceptance_hits_the_requested_rates_and_is_labelled(cuda_graphs):
    llm = LLM(model="tiny-moe", max_num_seqs=16, block_size=4, max_model_len=256, cuda_graphs=cuda_graphs,
              speculative_config={"num_speculative_tokens": 2}, emulated_acceptance=(0.8, 0.5))
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5 + i]} for i in range(16)],
                        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    st = llm.engine.spec_stats
    first, second = st.accepted_per_position[0] / st.num_drafts, st.accepted_per_position[1] / st.num_drafts
    sd = (0.25 / st.num_drafts) ** 0.5
    assert abs(first - 0.8) < 4 * sd and abs(second - 0.8 * 0.5) < 4 * sd
    assert all(o.outputs[0].emulated for o in outs)
    assert not LLM(model="tiny-moe").generate([{"prompt_token_ids": [1]}])[0].outputs[0].emulated
