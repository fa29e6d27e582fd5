"""Prefix-aware routing served: with 2 prefill workers, requests sharing a long prefix all go to one prefill worker
under cache_aware (the default) and hit its prefix cache, while a round_robin router over the same workers spreads
them so that none hits; every answer equals the colocated engine's without caching."""

import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams
from tandem.client import TandemClient
from tandem.launch import Child
from tandem.rpc.auth import INTERNAL_TOKEN_ENV
from tandem.worker_setup import DEFAULT_MODEL

K, BLOCK, MAX_LEN = 2, 4, 256
ENGINE = ["--model", DEFAULT_MODEL, "--dtype", "float32", "--num-speculative-tokens", str(K), "--block-size",
          str(BLOCK), "--max-model-len", str(MAX_LEN), "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, 512, (64,), generator=g).tolist()
    return [system + torch.randint(2, 512, (8 + i,), generator=g).tolist() for i in range(4)]


@pytest.fixture(scope="module")
def oracle():
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK,
              enable_prefix_caching=False, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    prompts = shared_prefix_prompts(17) + shared_prefix_prompts(18)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs]


def scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, s.labels.get("route")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def queried(addresses: list[str]) -> list[float]:
    return [scrape(a)[("tandem:prefix_cache_queries_total", None)] for a in addresses]


def routes(address: str) -> dict:
    got = scrape(address)
    return {r: got[("tandem:router_requests_total", r)] for r in ("prefix_hit", "least_loaded", "round_robin")}


def round_robin_router(c: Cluster) -> Child:
    """A second router over the same workers, with --routing-policy round_robin."""
    prefill = ",".join(a for n, a in sorted(c.workers.items()) if n.startswith("prefill"))
    decode = ",".join(a for n, a in c.workers.items() if n.startswith("decode"))
    return Child("router-rr", ["router", "--model", DEFAULT_MODEL, "--max-model-len", str(MAX_LEN),
                               "--num-speculative-tokens", str(K), "--host", "127.0.0.1", "--port", "0",
                               "--metrics-port", "0", "--log-level", "WARNING", "--prefill-workers", prefill,
                               "--decode-workers", decode, "--routing-policy", "round_robin"],
                 env={INTERNAL_TOKEN_ENV: c.internal_token})


def test_shared_prefix_lands_on_one_prefill_worker_and_round_robin_spreads_it(oracle):
    c = Cluster(*ENGINE, "--prefill-workers", "2", "--decode-workers", "1")
    rr = client = None
    try:
        prefill_metrics = c.metrics[1:3]
        prompts = shared_prefix_prompts(17)
        outs = [c.client.generate_unary(p, PARAMS, timeout=120) for p in prompts]  # one after another
        assert [list(o.token_ids) for o in outs] == oracle[:4]
        # all four on one prefill worker: the second request snapshots the shared prefix's last full block (60
        # tokens: with MTP a block's key takes the token after it, which must still be shared), the later ones
        # start there
        assert sorted(queried(prefill_metrics)) == [0, sum(map(len, prompts))]
        assert [o.cached_tokens for o in outs] == [0, 0, 60, 60]
        assert routes(c.metrics[0]) == {"prefix_hit": 3, "least_loaded": 1, "round_robin": 0}

        rr = round_robin_router(c)
        at = rr.wait_announced(time.monotonic() + 60)
        client = TandemClient(at["grpc"])
        client.wait_ready(30)
        before = queried(prefill_metrics)
        prompts = shared_prefix_prompts(18)  # a new prefix, cached nowhere
        outs = [client.generate_unary(p, PARAMS, timeout=120) for p in prompts]
        assert [list(o.token_ids) for o in outs] == oracle[4:]
        # in turn: each prefill worker gets two of them, and the second on each is the one that snapshots
        spread = [after - b for after, b in zip(queried(prefill_metrics), before)]
        assert sorted(spread) == sorted([len(prompts[0]) + len(prompts[2]), len(prompts[1]) + len(prompts[3])])
        assert [o.cached_tokens for o in outs] == [0, 0, 0, 0]
        assert routes(at["metrics"]) == {"prefix_hit": 0, "least_loaded": 0, "round_robin": 4}
        assert_idle(c)
    finally:
        if client is not None:
            client.close()
        if rr is not None:
            rr.proc.terminate()
            rr.proc.wait(30)
        assert c.stop() == 0
