"""Decode steps through persistent buffers and padded batch buckets (tandem/engine/graphs.py) against the eager
engine. On a CPU the padded path runs without capture; the gpu-marked tests capture real CUDA graphs."""

import pytest

from tandem.engine.graphs import batch_buckets
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

TINY = "models/tandem-tiny"
PROMPTS = ["Hello, how are you?", "Write a poem about the sea.", "What is 2+2?", "Tell me a story", "Hi"]


def _run(cuda_graphs, k, params, device="cpu", dtype="float32", model=TINY, prompts=PROMPTS):
    llm = LLM(model=model, max_num_seqs=8, max_model_len=256, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
              speculative_config={"num_speculative_tokens": k} if k else None)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm.engine.spec_stats, llm.engine


def test_buckets_cover_every_batch_size():
    for m in (1, 3, 8, 33, 64, 100):
        b = batch_buckets(m)
        assert b == sorted(set(b)) and b[-1] == m and b[0] == 1
        assert all(any(x >= n for x in b) for n in range(1, m + 1))


@pytest.mark.parametrize("k", [0, 2])
def test_padded_decode_equals_eager_greedy(k):
    """5 requests of different lengths: the batch shrinks through the 8-, 4- and 2-buckets (with padding requests);
    tokens and acceptance equal the eager engine's."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 12, 30, 20, 35)]
    eager, eager_stats, _ = _run(False, k, params)
    padded, padded_stats, engine = _run(True, k, params)
    assert padded == eager
    assert {2, 4, 8} <= set(engine.graphs.verify_graphs)
    if k:
        assert padded_stats.accepted_per_position == eager_stats.accepted_per_position
        assert padded_stats.num_accepted_tokens > 0  # tandem-tiny's MTP head really drafts


def test_padded_decode_equals_eager_seeded_and_streams_match_without_drafts():
    """Seeded top-p sampling: the padded path equals the eager one, and with k = 2 each request's generator
    advances by the tokens emitted, so its stream equals the one without speculation."""
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i) for i in range(len(PROMPTS))]
    eager, _, _ = _run(False, 2, params)
    padded, _, _ = _run(True, 2, params)
    plain, _, _ = _run(False, 0, params)
    assert padded == eager == plain


def test_penalties_and_stops_in_verify_rows():
    """Per-row sampling context (row j sees its first j drafts): penalties and min_tokens give the tokens they
    give without speculation."""
    params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                            min_tokens=10)
    plain, _, _ = _run(False, 0, params)
    padded, _, _ = _run(True, 2, params)
    assert padded == plain


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 2])
def test_cuda_graphs_equal_eager_on_gpu(k):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 12, 30, 20, 35)]
    eager, eager_stats, _ = _run(False, k, params, device="cuda")
    graphed, graphed_stats, engine = _run(True, k, params, device="cuda")
    assert engine.graphs.capture and engine.graphs.verify_graphs[8].graph is not None
    assert graphed == eager
    if k:
        assert graphed_stats.accepted_per_position == eager_stats.accepted_per_position
