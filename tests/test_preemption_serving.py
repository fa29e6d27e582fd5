"""Preemption through `tandem serve`, colocated and disaggregated: a decode worker whose pool holds about a
quarter of the workload serves all of it concurrently, exactly as the colocated engine with a large pool does; the
requests it preempts are recomputed on it, never failed; nothing stays allocated."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams
from tandem.rpc import common_pb2
from tandem.model.source import model_config
from tandem.worker_setup import DEFAULT_MODEL

K, MAX_LEN, BLOCKS = 2, 64, 57  # 56 usable blocks of 4 tokens: about a quarter of the workload's tokens
VOCAB = model_config(DEFAULT_MODEL).vocab_size
ENGINE = ["--model", DEFAULT_MODEL, "--dtype", "float32", "--num-speculative-tokens", str(K), "--block-size", "4",
          "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
          "--num-kv-blocks", str(BLOCKS)]


def workload():
    """16 greedy and 16 seeded stochastic requests of mixed lengths (~4x the pool's tokens in all)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB, (m,), generator=g).tolist() for m in torch.randint(3, 24, (32,), generator=g)]
    new = torch.randint(6, 24, (32,), generator=g).tolist()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) if i < 16 else
              SamplingParams(max_tokens=m, temperature=1.0, seed=i, ignore_eos=True) for i, m in enumerate(new)]
    return prompts, params


@pytest.fixture(scope="module")
def oracle():
    prompts, params = workload()
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", max_model_len=MAX_LEN, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def cluster(request):
    prefill = "0" if request.param == "colocated" else "1"
    c = Cluster(*ENGINE, "--prefill-workers", prefill, "--decode-workers", "1")
    yield c
    assert c.stop() == 0


def preemptions(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^tandem:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M))


def test_small_pool_serves_everything_as_a_large_one(cluster, oracle):
    prompts, params = workload()

    def run(i):
        out = cluster.client.generate_unary(prompts[i], params[i], timeout=300)
        return list(out.token_ids), common_pb2.FinishReason.Name(out.finish_reason)

    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once
        results = list(pool.map(run, range(len(prompts))))
    for i, (ids, reason) in enumerate(results):
        assert reason == "FINISH_REASON_LENGTH" and ids == oracle[i], i
    assert preemptions(cluster.metrics[-1]) > 0  # the decode worker's
    assert_idle(cluster)
