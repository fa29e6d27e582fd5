"""Prefix caching (KV blocks shared by content, GDN state snapshots): every request served from the cache gets the
tokens, logprobs and MTP drafts the same engine with caching off gives it, and reports the cached tokens the
design promises."""

import pytest
import torch

from tandem.cache.handoff import gather_state
from tandem.cache.prefix import BlockPool
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Status
from tandem.model.presets import preset_config, random_model

CFG = preset_config("tiny-moe")
MODEL = random_model(CFG, "cpu", torch.float32)


def tokens(n, seed):
    return torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(on=True, k=2, block=4, budget=32, **kw) -> Engine:
    kw = {"max_num_seqs": 8, "max_model_len": 512, **kw}
    return Engine(CFG, MODEL, EngineConfig(block_size=block, max_num_batched_tokens=budget, num_speculative_tokens=k,
                                           enable_prefix_caching=on, **kw))


def serve(eng: Engine, prompts, params, waves=None):
    """Serves the prompts in waves (each wave added once the one before finished; default: one request a wave).
    Returns per request (output tokens, logprobs, finish reason, every step's drafts, the cache state its prompt
    left: KV of every attention layer and the MTP layer at its positions, GDN states) and the cached tokens."""
    waves = waves or [[i] for i in range(len(prompts))]
    seqs, drafts, states = {}, {i: [] for i in range(len(prompts))}, {}
    for wave in waves:
        for i in wave:
            eng.add_request(str(i), prompts[i], params[i])
            seqs[i] = eng.sequences[str(i)]
        while eng.has_work():
            eng.step()
            for i in wave:  # the drafts after each step that advanced it past its prompt
                s = seqs[i]
                if s.status == Status.RUNNING and not s.in_prefill and drafts[i][-1:] != [(s.num_tokens, s.drafts)]:
                    drafts[i].append((s.num_tokens, list(s.drafts)))
                if i not in states and s.status == Status.RUNNING and s.num_computed == len(s.prompt_token_ids):
                    states[i] = prompt_state(eng, s)
    assert eng.pools.blocks.num_used == 0 and eng.pools.slots.num_used == 0  # shared blocks all returned
    out = [(s.output_token_ids, s.output_logprobs, s.finish_reason, drafts[i], states.get(i))
           for i, s in sorted(seqs.items())]
    return out, [seqs[i].num_cached_tokens or 0 for i in range(len(prompts))]


def prompt_state(eng: Engine, seq) -> dict:
    n = len(seq.prompt_token_ids)
    return {name: t.flatten(0, 1)[:n] if name.endswith((".k", ".v")) else t
            for name, t in gather_state(eng.cfg, eng.pools, seq, eng.ecfg.block_size)}


def assert_same(got, want):
    for (toks, lps, why, drafts, state), (toks_o, lps_o, why_o, drafts_o, state_o) in zip(got, want, strict=True):
        assert toks == toks_o and why == why_o
        assert drafts == drafts_o
        for a, b in zip(lps, lps_o, strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        # the state after the prompt, MTP entries at the edge of the cached blocks included
        assert (state is None) == (state_o is None)
        for name in state or ():
            torch.testing.assert_close(state[name], state_o[name], atol=1e-5, rtol=1e-5, msg=name)


def greedy(n, max_tokens=6):
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)] * n


def test_block_pool_refcounts_and_evicts_least_recent():
    pool = BlockPool(6)
    a = pool.allocate(3)
    for b, key in zip(a, (10, 11, 12)):
        pool.register(b, key)
    pool.share([a[0]])
    pool.free(a)  # a[0] still used once; a[1], a[2] cached and unused, the tail first in line
    assert (pool.num_used, pool.num_free, pool.num_cached) == (1, 4, 3)
    assert pool.num_unused(a) == 2 and pool.lookup(12) == a[2]
    pool.allocate(2)  # the two never-used blocks
    pool.allocate(1)  # evicts the least recent unused block: a[2] (freed first: the tail of a)
    assert pool.lookup(12) is None and pool.lookup(11) == a[1]
    pool.share([a[1]])  # a cached unused block back in use: no longer evictable
    assert pool.num_free == 0 and pool.num_unused([a[1]]) == 0
    pool.free([a[0], a[1]])
    assert pool.num_used == 3 and pool.num_free == 2
    with pytest.raises(ValueError):
        pool.free([a[0]])


def test_shared_system_prompt():
    """A 300-token system prompt: the second request finds it cached but without a state at its end, snapshots
    its branch point, and every later one starts from there (>= 288 tokens). (MTP k = 2 at a block edge and
    inside blocks: `test_prompts_diverging_at_and_inside_blocks`.)"""
    system = tokens(300, 1)
    prompts = [system + tokens(9 + i, 10 + i) for i in range(4)]
    params = greedy(4, max_tokens=3)
    kw = {"k": 0, "block": 16, "budget": 512}
    want, _ = serve(engine(on=False, **kw), prompts[2:], params[2:])  # the first two compute all of it
    eng = engine(**kw)
    got, cached = serve(eng, prompts, params)
    assert_same(got[2:], want)
    assert cached[:2] == [0, 0] and all(c >= 288 for c in cached[2:]), cached
    prefix = eng.scheduler.prefix
    assert prefix.hits == sum(cached) and prefix.queries == sum(map(len, prompts))


@pytest.mark.parametrize("k", [2])
def test_multi_turn_conversation(k):
    """Each turn's prompt is the last prompt, its answer and a new message: it starts at least from the last
    prompt's end snapshot."""
    turns, params = [tokens(21, 2)], greedy(1, max_tokens=7)[0]
    outs_on, outs_off, cached = [], [], []
    eng_on, eng_off = engine(k=k), engine(on=False, k=k)
    for t in range(3):
        got, c = serve(eng_on, [turns[-1]], [params])
        want, _ = serve(eng_off, [turns[-1]], [params])
        outs_on.append(got[0])
        outs_off.append(want[0])
        cached.append(c[0])
        turns.append(turns[-1] + want[0][0] + tokens(5 + t, 20 + t))
    assert_same(outs_on, outs_off)
    assert cached[0] == 0
    for t in range(1, 3):
        assert cached[t] >= (len(turns[t - 1]) - 1) // 4 * 4, (t, cached)


# at a block edge (with and without MTP), and 3 tokens into the next block
@pytest.mark.parametrize("k, shared", [(0, 24), (2, 24), (2, 27)])
def test_prompts_diverging_at_and_inside_blocks(k, shared):
    """Three prompts sharing `shared` tokens: the third starts from the branch point the second snapshotted, the
    last full block before the divergence -- one block earlier at an edge with MTP, whose entry at the block's
    last position was computed with the (diverging) next token."""
    common = tokens(shared, 3)
    prompts = [common + tokens(7, 30 + i) for i in range(3)]
    params = greedy(3)
    want, _ = serve(engine(on=False, k=k), prompts, params)
    got, cached = serve(engine(k=k), prompts, params)
    assert_same(got, want)
    edge = shared % 4 == 0 and k > 0
    assert cached == [0, 0, (shared // 4 - edge) * 4]


def test_chunked_prefill_budgets():
    """Prompts sharing prefixes of several lengths, some added together, at several step budgets (chunks end
    at snapshot points, every 8 tokens too): the same outputs as without caching at a budget that fits whole
    prompts. The first prompt snapshots every 8 tokens; a later one starts from the last of those within what it
    shares with the cache, the token after the block included (33 shared tokens give 32, 17 give 16), and a
    repeated prompt from its earlier run's end snapshot (the third and fifth repeat the first and second: 44, 36)."""
    base = tokens(40, 4)
    prompts = [base[:n] + tokens(5, 40 + n) for n in (40, 33, 40, 17, 33)]
    params = greedy(5, max_tokens=4)
    waves = [[0], [1, 2], [3, 4]]
    want, _ = serve(engine(on=False, budget=64), prompts, params, waves)
    for budget in (5, 12, 64):
        got, cached = serve(engine(budget=budget, prefix_state_interval=8), prompts, params, waves)
        assert_same(got, want)
        assert cached == [0, 32, 44, 16, 36], (budget, cached)


def test_seeded_sampling():
    system = tokens(30, 5)
    prompts = [system + tokens(4, 50 + i) for i in range(3)]
    params = [SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=1) for i in range(3)]
    want, _ = serve(engine(on=False), prompts, params)
    got, cached = serve(engine(), prompts, params)
    assert_same(got, want)
    assert cached == [0, 0, 28]


def test_small_pool_evicts_and_stays_exact():
    """Many prompts over a few prefixes, several at once, in a pool that holds a few of them: cached blocks and
    snapshots are evicted (and requests preempted), outputs stay those of a large pool without caching, and no
    block stays referenced."""
    bases = [tokens(28, 60 + b) for b in range(3)]
    prompts = [bases[i % 3] + tokens(3 + i % 5, 70 + i) for i in range(12)]
    params = greedy(12, max_tokens=5)
    waves = [list(range(w, w + 4)) for w in range(0, 12, 4)]
    want, _ = serve(engine(on=False, max_model_len=128), prompts, params, waves)
    small = engine(num_kv_blocks=48, num_state_snapshots=3, max_model_len=128)
    got, cached = serve(small, prompts, params, waves)
    assert_same(got, want)
    prefix = small.scheduler.prefix
    assert sum(cached) > 0 and prefix.snapshots.num_evicted > 0 and small.pools.blocks.num_evicted > 0


def test_llm_reports_cached_tokens():
    from tandem import LLM

    llm = LLM(model="tiny-moe", block_size=4, max_model_len=128, max_num_seqs=2)
    prompt = {"prompt_token_ids": tokens(23, 6)}
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 20)  # the prompt's end snapshot: 22 // 4 * 4
