"""Prefix caching served: a cached prefill worker (disaggregated) and a cached colocated decode worker answer
requests that share a prefix exactly as the colocated engine without caching does, report the cached tokens in
the gRPC answer and OpenAI's usage, and count them in their metrics."""

import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams
from tandem.worker_setup import DEFAULT_MODEL

K, BLOCK = 2, 4
ENGINE = ["--model", DEFAULT_MODEL, "--dtype", "float32", "--num-speculative-tokens", str(K), "--block-size",
          str(BLOCK), "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]


def workload():
    g = torch.Generator().manual_seed(17)
    system = torch.randint(2, 512, (45,), generator=g).tolist()
    prompts = [system + torch.randint(2, 512, (8 + i,), generator=g).tolist() for i in range(4)]
    return prompts, SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def oracle():
    prompts, params = workload()
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", max_model_len=256, block_size=BLOCK, enable_prefix_caching=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def prefix_metrics(address: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["tandem:prefix_cache_queries_total"], values["tandem:prefix_cache_hits_total"]


@pytest.mark.parametrize("prefill_workers", ["1", "0"])  # disaggregated: P serves hits; colocated: D does
def test_served_hits_equal_colocated_engine_without_cache(oracle, prefill_workers):
    prompts, params = workload()
    c = Cluster(*ENGINE, "--prefill-workers", prefill_workers, "--decode-workers", "1")
    try:
        cached = []
        for p, want in zip(prompts[:3], oracle):  # one after another: each finds what the ones before cached
            out = c.client.generate_unary(p, params, timeout=120)
            assert list(out.token_ids) == want
            cached.append(out.cached_tokens)
        client = openai.OpenAI(base_url=f"http://{c.http}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[3], max_tokens=10,
                                      temperature=0.0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # the second request snapshots the shared prefix's last full block (44 tokens: the block key takes the
        # token after it, still shared), the ones after start there
        assert cached == [0, 0, 44, 44]
        assert_idle(c)
        worker = c.metrics[1]  # the prefill worker (disaggregated) or the decode worker (colocated)
        assert prefix_metrics(worker) == (sum(map(len, prompts)), sum(cached))
    finally:
        assert c.stop() == 0
