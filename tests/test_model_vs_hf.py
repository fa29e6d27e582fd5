"""Our packed-batch model against Hugging Face transformers (fp32, max abs diff <= 1e-4)."""

import pytest
import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.engine import Engine
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.loader import load_checkpoint
from admitted import admitted

TOL = 1e-4


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def make_engine(path, **kw):
    cfg = ModelConfig.from_dir(path)
    model = load_checkpoint(path, cfg, "cpu", torch.float32, progress=False)
    return Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=8, max_model_len=128, **kw))



def prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_packed_batch_of_prompts(hf_checkpoints, kind):
    hf, path = hf_checkpoints[kind]
    eng = make_engine(path)
    ps = prompts(eng.cfg.vocab_size, [1, 7, 19, 33])
    seqs = [admitted(eng, str(i), p) for i, p in enumerate(ps)]
    logits = eng.runner.run([ScheduledChunk(s, len(p)) for s, p in zip(seqs, ps)], all_rows=True)
    ref = torch.cat([hf_logits(hf, p) for p in ps])
    assert (logits - ref).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill(hf_checkpoints, kind, chunk):
    hf, path = hf_checkpoints[kind]
    eng = make_engine(path)
    (p,) = prompts(eng.cfg.vocab_size, [21], seed=2)
    seq = admitted(eng, "a", p)
    got = []
    while seq.num_computed < len(p):
        n = min(chunk, len(p) - seq.num_computed)
        got.append(eng.runner.run([ScheduledChunk(seq, n)], all_rows=True))
    assert (torch.cat(got) - hf_logits(hf, p)).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_decode_after_prefill_mixed_with_prefill(hf_checkpoints, kind):
    """One request decodes token by token while another prefills in chunks in the same batches."""
    hf, path = hf_checkpoints[kind]
    eng = make_engine(path)
    dec_prompt, pre_prompt = prompts(eng.cfg.vocab_size, [9, 30], seed=3)
    follow = prompts(eng.cfg.vocab_size, [8], seed=4)[0]  # teacher-forced decode tokens
    a, b = admitted(eng, "a", dec_prompt), admitted(eng, "b", pre_prompt)
    eng.runner.run([ScheduledChunk(a, len(dec_prompt))])
    a.prompt_token_ids = dec_prompt + follow  # feed the next tokens one at a time
    got_a, got_b = [], []
    for _ in follow:
        nb = min(4, len(pre_prompt) - b.num_computed)
        chunks = [ScheduledChunk(a, 1)] + ([ScheduledChunk(b, nb)] if nb else [])
        rows = eng.runner.run(chunks, all_rows=True)
        got_a.append(rows[:1])
        got_b.append(rows[1:])
    ref_a = hf_logits(hf, dec_prompt + follow)[len(dec_prompt) : len(dec_prompt) + len(follow)]
    ref_b = hf_logits(hf, pre_prompt)[: b.num_computed]
    assert (torch.cat(got_a) - ref_a).abs().max() <= TOL
    assert (torch.cat(got_b) - ref_b).abs().max() <= TOL
