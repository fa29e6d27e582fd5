"""Piecewise prefill graphs (tandem/engine/prefill_graphs.py) against the plain forward: the row-wise parts over
padded static buffers, the cores (attention, GDN conv and recurrence) on the step's own rows. On a CPU the padded
path runs without capture; the gpu-marked test captures real CUDA graphs."""

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.prefill_graphs import token_buckets
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledChunk
from tandem.model.presets import preset_config, random_model
from admitted import admitted


def test_buckets_cover_every_token_count():
    for m in (1, 48, 64, 200, 2048, 3000, 4096):
        b = token_buckets(m)
        assert b == sorted(set(b)) and b[-1] == m
        assert all(any(x >= n for x in b) for n in range(1, m + 1))
        # padding: at most half of a step, at most a third past 512 rows
        assert all(y <= 2 * x and (x < 512 or y - x <= x / 2) for x, y in zip(b, b[1:]))
    assert token_buckets(2048)[4:] == list(range(768, 2049, 256))


def engine(cfg, model, graphs, device="cpu", **kw):
    # sized, not profiled on a GPU: each engine of a process would take 0.9 of the device's memory
    return Engine(cfg, model, EngineConfig(block_size=4, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=200,
                                           device=device, cuda_graphs=graphs, num_kv_blocks=8 * 64 + 1, **kw))


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]



def prefill_logits(eng, batches):
    """Logits at every row of each packed prefill batch in turn (each a list of prompts), and the KV caches after."""
    out, n = [], 0
    for ps in batches:
        seqs = [admitted(eng, str(n + i), p) for i, p in enumerate(ps)]
        n += len(ps)
        out.append(eng.runner.run([ScheduledChunk(s, len(p)) for s, p in zip(seqs, ps)], all_rows=True))
    return out


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-moe-fp8"])
def test_piecewise_prefill_equals_the_plain_forward(name):
    """Steps of 13, 70, 7 and 200 rows (buckets 64, 128, 64 again, 200): the same logits at every row, the same
    KV and GDN states, and the padding rows' KV lands in the null block only. The FP8 preset computes W8A8 (its
    torch reference): activations are quantised per token, so padding rows change nothing either."""
    cfg = preset_config(name)
    model = random_model(cfg, "cpu", torch.float32, seed=4, fp8_compute=cfg.quantization is not None)
    batches = [prompts([5, 8]), prompts([70], seed=2), prompts([7], seed=3), prompts([150, 50], seed=4)]
    plain, piecewise = engine(cfg, model, False), engine(cfg, model, True)
    assert plain.runner.prefill_graphs is None and piecewise.runner.prefill_graphs is not None
    want, got = prefill_logits(plain, batches), prefill_logits(piecewise, batches)
    for a, b in zip(got, want):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    outs = piecewise.runner.prefill_graphs.cpu_outs
    assert set(outs) == {64, 128, 200}
    # each core's output is one buffer for every bucket, not one per bucket
    assert all(o.data_ptr() == p.data_ptr() for b in (64, 128) for o, p in zip(outs[b], outs[200]))
    for (a, b, *_), (c, d, *_) in zip(piecewise.pools.layer_caches, plain.pools.layer_caches):
        # KV blocks and GDN state slots; only the null block / slot (0) takes the padding rows' writes
        assert (a[1:] - c[1:]).abs().max() <= 1e-4 and (b[1:] - d[1:]).abs().max() <= 1e-4


@pytest.mark.parametrize("k", [0, 2])
def test_piecewise_engine_generates_the_plain_tokens(k):
    """Whole requests through the engine (chunked prompts, decode steps, MTP drafts over prompt rows)."""
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cpu", torch.float32, seed=5)
    outs = []
    for graphs in (False, True):
        eng = engine(cfg, model, graphs, num_speculative_tokens=k)
        for i, p in enumerate(prompts([3, 230, 40, 9, 120], seed=6)):
            eng.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        done = {}
        while eng.has_work():
            done.update({s.request_id: list(s.output_token_ids) for s in eng.step()})
        outs.append(done)
    assert outs[0] == outs[1] and len(outs[0]) == 5


@pytest.mark.gpu
def test_captured_prefill_graphs_equal_the_plain_forward():
    """Real CUDA graphs (tiny-moe, fp32): every bucket captured up front, then steps of several sizes per bucket
    replay them; and an engine that captures each bucket on its first step. Logits and states equal the plain
    forward's."""
    cfg = preset_config("tiny-moe")
    model = random_model(cfg, "cuda", torch.float32, seed=4)
    batches = [prompts([5, 8]), prompts([70], seed=2), prompts([7], seed=3), prompts([150, 50], seed=4),
               prompts([3, 60], seed=5)]  # 8 requests: max_num_seqs
    plain, piecewise, lazy = (engine(cfg, model, graphs, "cuda") for graphs in (False, True, True))
    piecewise.capture_graphs()
    assert set(piecewise.runner.prefill_graphs.pieces) == set(token_buckets(200))
    want = prefill_logits(plain, batches)
    for eng in (piecewise, lazy):
        for a, b in zip(prefill_logits(eng, batches), want):
            assert (a - b).abs().max() <= 1e-4
        for (a, b, *_), (c, d, *_) in zip(eng.pools.layer_caches, plain.pools.layer_caches):
            assert (a[1:] - c[1:]).abs().max() <= 1e-4 and (b[1:] - d[1:]).abs().max() <= 1e-4
    assert set(lazy.runner.prefill_graphs.pieces) == {64, 128, 200}
