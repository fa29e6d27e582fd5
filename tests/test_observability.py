"""Metrics scraped from the router and both workers after real requests move by exactly what was served; a SIGTERM
during traffic drains (readiness off, liveness on) and fails no in-flight request."""

import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, assert_idle
from tandem import SamplingParams

ENGINE = ["--model", "tiny-moe", "--num-speculative-tokens", "2", "--block-size", "4", "--max-model-len", "512",
          "--max-num-seqs", "8"]


def scrape(address: str) -> dict:
    """{(sample name, sorted labels without model_name/worker): value}"""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "worker")))
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def cluster():
    """One `tandem serve` for both tests (file order): the metrics test reads its fresh counters, then the SIGTERM
    test ends it. Emulated acceptance: real verify steps, some drafts accepted, some not."""
    c = Cluster(*ENGINE, "--emulated-acceptance", "0.9,0.5", "--drain-timeout", "60")
    yield c
    assert c.stop() == 0


def test_metrics_count_what_was_served(cluster):
    c = cluster
    prompts = [[3 + i] * (5 + 3 * i) for i in range(6)]
    max_new = [4 + 5 * i for i in range(6)]
    threads = [threading.Thread(target=lambda p=p, m=m: list(c.client.generate(
        p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), timeout=60)))
        for p, m in zip(prompts, max_new)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_idle(c)
    router, prefill, decode = (scrape(a) for a in c.metrics)
    n, prompt_tokens, generated = len(prompts), sum(map(len, prompts)), sum(max_new)

    assert router[("tandem:time_to_first_token_seconds_count", ())] == n
    assert router[("tandem:e2e_request_latency_seconds_count", ())] == n
    assert router[("tandem:request_success_total", (("finished_reason", "length"),))] == n
    assert router[("tandem:request_success_total", (("finished_reason", "error"),))] == 0
    assert router[("tandem:prompt_tokens_total", ())] == prompt_tokens
    assert router[("tandem:generation_tokens_total", ())] == generated
    assert router[("tandem:num_requests_running", ())] == 0
    assert 0 < router[("tandem:inter_token_latency_seconds_count", ())] <= generated - n
    healthy = [v for (name, _), v in router.items() if name == "tandem:worker_healthy"]
    assert healthy == [1.0, 1.0]

    assert prefill[("tandem:prompt_tokens_total", ())] == prompt_tokens
    assert prefill[("tandem:request_prefill_time_seconds_count", ())] == n
    assert prefill[("tandem:handoff_seconds_count", ())] == n
    assert prefill[("tandem:handoff_bytes_total", ())] == decode[("tandem:handoff_bytes_total", ())] > 0

    assert decode[("tandem:generation_tokens_total", ())] == generated - n  # the first tokens came from P
    assert decode[("tandem:request_decode_time_seconds_count", ())] == n
    drafts = decode[("tandem:spec_decode_num_draft_tokens_total", ())]
    accepted = decode[("tandem:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [decode[("tandem:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(2)]
    assert 0 < accepted < drafts and sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    assert drafts == 2 * decode[("tandem:spec_decode_num_drafts_total", ())]
    # every token after the first is the bonus of a verify step or an accepted draft
    assert decode[("tandem:spec_decode_num_drafts_total", ())] + accepted == generated - n
    assert decode[("tandem:kv_cache_usage_perc", ())] == 0 and decode[("tandem:leases_active", ())] == 0


def _ready(address: str, service: str):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_sigterm_drains_without_failing_in_flight_requests(cluster):
    c = cluster
    results, errors = [], []
    first_tokens = threading.Semaphore(0)

    def run(i):
        try:
            ids = []
            for m in c.client.generate([7, 8, 9 + i], SamplingParams(max_tokens=150, temperature=0.0,
                                                                     ignore_eos=True), timeout=120):
                if not ids:
                    first_tokens.release()
                ids += m.token_ids
            results.append((len(ids), m.finish_reason))
        except grpc.RpcError as e:
            errors.append(e)
            first_tokens.release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    try:
        assert _ready(c.address, "tandem.v1.Tandem") == health_pb2.HealthCheckResponse.SERVING
        for t in threads:
            t.start()
        for _ in threads:
            assert first_tokens.acquire(timeout=60)
        c.proc.send_signal(signal.SIGTERM)
        # inside the 60 s drain (it takes milliseconds; the generous bound is for a loaded 2-core machine)
        deadline = time.monotonic() + 50
        while _ready(c.address, "tandem.v1.Tandem") == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "readiness did not turn off"
            time.sleep(0.05)
        if len(results) < len(threads):  # still draining: alive (not restarted) but not ready
            assert _ready(c.address, "") == health_pb2.HealthCheckResponse.SERVING
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(results) == 8 and all(r == (150, 2) for r in results), results  # 2: FINISH_REASON_LENGTH
        assert c.proc.wait(60) == 0
    finally:
        c.stop()
