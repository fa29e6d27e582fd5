"""Decode steps through persistent buffers and padded batch buckets (tandem/engine/graphs.py) against the eager
engine. On a CPU the padded path runs without capture; the gpu-marked tests capture real CUDA graphs."""

import warnings

import pytest
import torch

from tandem.engine.graphs import DecodeGraphs, batch_buckets
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec import SpecStats

TINY = "models/tandem-tiny"
PROMPTS = ["Hello, how are you?", "Write a poem about the sea.", "What is 2+2?", "Tell me a story", "Hi"]


def _run(cuda_graphs, k, params, device="cpu", dtype="float32", model=TINY, prompts=PROMPTS, max_num_seqs=8,
         emulated_acceptance=None, outputs=False):
    # sized, not profiled on a GPU: each engine of a process would take 0.9 of the device's memory
    llm = LLM(model=model, max_num_seqs=max_num_seqs, max_model_len=256, device=device, dtype=dtype,
              kv_cache_memory_bytes=1 << 28, cuda_graphs=cuda_graphs,
              speculative_config={"num_speculative_tokens": k} if k else None, emulated_acceptance=emulated_acceptance)
    outs = llm.generate(prompts, params)
    if outputs:
        return [o.outputs[0] for o in outs]
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


def test_narrow_block_table_uploads_equal_eager():
    """A step sends only the block-table columns its requests use: a long request that leaves a row with many
    blocks behind, then short ones in that row (stale columns past their blocks), decode as the eager engine."""
    prompts = [" ".join(["the sea and the sky"] * 30), *PROMPTS[:3]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 40, 30, 35)]
    eager, _, _ = _run(False, 2, params, prompts=prompts, max_num_seqs=2)
    padded, _, engine = _run(True, 2, params, prompts=prompts, max_num_seqs=2)
    assert padded == eager
    assert engine.graphs.width < engine.graphs.max_blocks // 2  # the last steps sent a narrow table


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


def test_stops_inside_accepted_drafts_and_reused_blocks_equal_plain(monkeypatch):
    """k = 3, two seats for five requests: requests stop (a stop token, max_tokens) at rows after which the device
    accepted more drafts, and waiting requests take their blocks and slots while others keep verifying. Every
    request's tokens are its k = 0 continuation cut at its stop token's first occurrence or at max_tokens."""
    free, _, _ = _run(False, 0, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))

    def stop_at(out, i):  # a token first seen at index >= i, or (None) one that never comes
        return max(out) + 1 if i is None else next(out[j] for j in range(i, len(out)) if out[j] not in out[:j])

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at(out, i)])
              for out, (m, i) in zip(free, [(30, 12), (13, None), (22, 9), (17, None), (26, 5)])]
    device_accepted, host_accepted = [], []  # per verified request, in order
    accept_and_draft, record = DecodeGraphs.accept_and_draft, SpecStats.record

    def spy_device(self, tokens):
        out = accept_and_draft(self, tokens)
        device_accepted.extend(out[1])
        return out

    def spy_host(self, num_drafted, num_accepted):
        host_accepted.append(num_accepted)
        record(self, num_drafted, num_accepted)

    monkeypatch.setattr(DecodeGraphs, "accept_and_draft", spy_device)
    monkeypatch.setattr(SpecStats, "record", spy_host)
    outs = _run(True, 3, params, max_num_seqs=2, outputs=True)
    for out, p, o in zip(free, params, outs):
        stop = p.stop_token_ids[0]
        cut = min(out.index(stop) + 1 if stop in out else len(out), p.max_tokens)
        assert o.token_ids == out[:cut]
        assert o.finish_reason == ("stop" if out[cut - 1] == stop else "length")
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    # the case under test happened: a request stopped at a row before the device's last accepted one
    assert any(h < d for h, d in zip(host_accepted, device_accepted, strict=True))


def test_padded_decode_equals_eager_under_emulated_acceptance():
    """Emulated acceptance is drawn before each step: the device applies the same decisions to the same tokens as
    the eager engine's host loop (equal tokens and acceptance per position), with requests stopping mid-step."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 13, 30, 21, 35)]
    rates = (0.9, 0.7, 0.5)
    eager, eager_stats, _ = _run(False, 3, params, max_num_seqs=3, emulated_acceptance=rates)
    padded, padded_stats, _ = _run(True, 3, params, max_num_seqs=3, emulated_acceptance=rates)
    assert padded == eager
    assert padded_stats.accepted_per_position == eager_stats.accepted_per_position
    assert padded_stats.num_drafts == eager_stats.num_drafts


def test_padded_logprobs_equal_plain():
    """Logprobs on the graph path with k = 2 (sampled per verify row, kept for the emitted tokens only) equal the
    ones without speculation."""
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, logprobs=3) for i in range(len(PROMPTS))]
    plain = _run(False, 0, params, outputs=True)
    padded = _run(True, 2, params, outputs=True)
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


@pytest.mark.gpu
def test_graph_verify_step_waits_for_the_device_once():
    """torch's sync debug mode counts the host syncs of each pure decode step (k = 2, CUDA graphs) with greedy,
    seeded top-p, penalised and min_tokens requests in one batch: one, the read of tokens, acceptance and drafts."""
    llm = LLM(model=TINY, max_num_seqs=8, max_model_len=256, device="cuda", cuda_graphs=True,
              kv_cache_memory_bytes=1 << 28, speculative_config={"num_speculative_tokens": 2})
    engine = llm.engine
    engine.capture_graphs()  # capturing a bucket on first use synchronises
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3),
              SamplingParams(max_tokens=30, temperature=1.0, min_tokens=20)]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), llm._prompt_ids(prompt), p)
    engine.step()  # every prompt in one prefill step
    assert not any(s.in_prefill for s in engine.sequences.values())
    syncs = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_work():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            syncs.append(sum("synchronizing" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs and all(n == 1 for n in syncs), syncs


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


@pytest.mark.gpu
def test_early_launch_changes_no_token_on_gpu(monkeypatch):
    """Programmatic dependent launch (every Triton kernel scheduled while the one before runs, then waiting for
    it) only moves when kernels start: CUDA-graph decode with MTP gives the tokens and acceptance of launching
    each kernel after the one before has finished. A kernel reading or writing memory before its wait would race."""
    from tandem.ops import triton_utils

    if not triton_utils.pdl(torch.empty(1, device="cuda"))["launch_pdl"]:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 12, 30, 20, 35)]
    early, early_stats, _ = _run(True, 2, params, device="cuda")
    monkeypatch.setattr(triton_utils, "PDL_OFF", True)
    serial, serial_stats, _ = _run(True, 2, params, device="cuda")
    assert early == serial
    assert early_stats.accepted_per_position == serial_stats.accepted_per_position
