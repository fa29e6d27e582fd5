"""Tensor parallelism on the CPU: two ranks over gloo (a spawned process for rank 1) give the one-rank output.

fp32 logits agree to ~1e-5 (the all-reduce sums partial products in another order than the unsplit matmul), greedy
tokens exactly; shards loaded from a checkpoint or drawn for a preset are exactly the one-rank weights cut up.
"""

import pytest
import torch
from test_loader import clone_dir, read_all, to_official_layout

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.loader import load_checkpoint
from tandem.model.presets import preset_config, random_model
from tandem.engine.tensor_parallel import TensorParallelError
from tandem.parallel import TPGroup
from admitted import admitted

TOL = 1e-5
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, max_model_len=128)
LENGTHS, MAX_NEW = [3, 20, 7, 13, 1], [12, 8, 10, 6, 9]


def spec(k):
    return {"method": "mtp", "num_speculative_tokens": k} if k else None


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


def greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_NEW])
    assert llm.engine.pools.blocks.num_used == 0 and llm.engine.pools.slots.num_used == 0
    return [o.outputs[0].token_ids for o in outs]


def step_logits(llm):
    """Logits of every row of a packed prefill step of three prompts, then of a step mixing decodes and a chunk."""
    eng = llm.engine
    ps = prompts([1, 7, 19], seed=3)
    seqs = []
    for i, p in enumerate(ps):
        seqs.append(admitted(eng, f"l{i}", p, max_tokens=8))
    first = eng.runner.run([ScheduledChunk(s, min(len(p), 8)) for s, p in zip(seqs, ps)], all_rows=True)
    for s, p in zip(seqs, ps):
        s.prompt_token_ids.append(p[0])  # a teacher-forced next token for the finished prompts
    chunks = [ScheduledChunk(s, len(s.prompt_token_ids) - s.num_computed) for s in seqs]
    second = eng.runner.run(chunks, all_rows=True)
    for s in seqs:
        eng.scheduler.finish(s, "abort")
    assert eng.pools.blocks.num_used == 0
    return torch.cat([first, second])


@pytest.fixture(scope="module")
def tp2():
    """(preset, k) -> a TP = 2 LLM; every process is stopped at the end."""
    made = {}

    def get(name, k):
        if (name, k) not in made:
            made[name, k] = LLM(model=name, speculative_config=spec(k), tensor_parallel_size=2, **ENGINE)
        return made[name, k]

    yield get
    for llm in made.values():
        procs = llm.engine.runner.model._followers.procs
        llm.close()
        assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_logits_match_one_rank(tp2, name):
    one = step_logits(LLM(model=name, **ENGINE))
    two = step_logits(tp2(name, 0))
    assert one.shape == two.shape
    assert (one - two).abs().max() <= TOL


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_greedy_generate_matches_one_rank(tp2, name):
    base = greedy(LLM(model=name, **ENGINE))
    assert greedy(tp2(name, 0)) == base
    assert greedy(tp2(name, 2)) == base  # MTP drafting and verification across ranks too


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_preset_shards_are_the_full_weights_cut(name):
    cfg = preset_config(name)
    full = dict(random_model(cfg, "cpu", torch.float32, seed=3).named_parameters())
    for rank in range(2):
        tp = TPGroup(rank, 2)  # loading needs no process group
        part = random_model(cfg, "cpu", torch.float32, seed=3, tp=tp)
        splits = part.parameter_splits()
        assert splits  # heads, channels and experts really are split
        for n, p in part.named_parameters():
            assert torch.equal(p, tp.shard(full[n], splits[n]) if n in splits else full[n]), n


@pytest.mark.parametrize("kind", ["next", "official"])
def test_checkpoint_shards_are_the_full_weights_cut(hf_checkpoints, kind, tmp_path):
    """Per-expert save_pretrained with Qwen3-Next's packed projections, and the fused official layout with mtp.*."""
    _, path = hf_checkpoints["next" if kind == "next" else "moe"]
    cfg = ModelConfig.from_dir(path)
    if kind == "official":
        path = clone_dir(path, tmp_path / "official", to_official_layout(read_all(path), cfg)[0])
    full = dict(load_checkpoint(str(path), cfg, "cpu", torch.float32, progress=False).named_parameters())
    for rank in range(2):
        tp = TPGroup(rank, 2)
        part = load_checkpoint(str(path), cfg, "cpu", torch.float32, progress=False, tp=tp)
        splits = part.parameter_splits()
        assert part.model.layers[0].mlp.experts.gate_up_proj.shape[0] == cfg.num_experts // 2
        for n, p in part.named_parameters():
            assert torch.equal(p, tp.shard(full[n], splits[n]) if n in splits else full[n]), n


def test_checkpoint_directory_generates_like_one_rank(hf_checkpoints):
    _, path = hf_checkpoints["next"]
    base = greedy(LLM(model=path, **ENGINE))
    with LLM(model=path, tensor_parallel_size=2, **ENGINE) as llm:
        assert greedy(llm) == base


def test_sizes_that_do_not_split_are_refused():
    """Refused before any process starts, naming every size that does not divide."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide num_key_value_heads \(2\), "
                                         r"linear_num_key_heads \(2\), num_experts \(8\)$"):
        LLM(model="tiny-moe", tensor_parallel_size=3)


def test_a_lost_rank_is_an_error_not_a_hang():
    llm = LLM(model="tiny-dense", tensor_parallel_size=2, max_num_seqs=2, max_model_len=64)
    followers = llm.engine.runner.model._followers
    followers.procs[0].kill()
    followers.procs[0].join(10)
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    assert llm.engine.pools.blocks.num_used == 0  # the request was ended
    llm.close()
