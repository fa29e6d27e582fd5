"""tandem.metrics: what a registry exposes equals Metrics.names(), buckets are vLLM's, labels are bound."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tandem import metrics as tm
from tandem.metrics import Metrics

# vLLM's boundaries, transcribed from vllm/v1/metrics/loggers.py independently of tandem/metrics.py
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0]


def samples(m: Metrics):
    """[(sample name, labels, value)] from the text exposition, as a scraper parses it."""
    text = m.generate_latest().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def touch_everything(m: Metrics):
    for attr in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gdn_state_slot_usage_perc",
                 "leases_active"):
        getattr(m, attr).set(0.5)
    for attr in ("prompt_tokens_total", "generation_tokens_total", "lease_expiries_total"):
        getattr(m, attr).inc(3)
    m.time_to_first_token_seconds.observe(0.05)
    m.inter_token_latency_seconds.observe(0.02)
    m.request_finished("stop", e2e=1.2, queue=0.01, prefill=0.2, decode=1.0)
    m.record_spec_decode(num_drafts=4, num_draft_tokens=8, accepted_per_position=[3, 2])
    m.handoff_done(nbytes=1 << 20, seconds=0.003)
    m.handoff_failed("transport")
    m.set_worker_healthy("prefill-0", "prefill", True)
    m.engine_step_seconds("mixed").observe(0.08)
    m.engine_step_prompt_tokens_total("mixed").inc(1820)
    m.record_preemptions(2)
    m.set_cache_config(num_gpu_blocks=1025, block_size=16, num_state_slots=64)


def test_exposed_names_equal_names():
    m = Metrics("tiny-moe", "test", registry=CollectorRegistry())
    touch_everything(m)
    exposed = {name for name, _, _ in samples(m)}
    assert exposed == set(Metrics.names())
    assert not any(n.endswith("_created") for n in exposed)


def test_names_are_vllm_style():
    names = set(Metrics.names())
    for n in ("tandem:time_to_first_token_seconds_bucket", "tandem:time_to_first_token_seconds_sum",
              "tandem:time_to_first_token_seconds_count", "tandem:request_success_total",
              "tandem:prompt_tokens_total", "tandem:generation_tokens_total", "tandem:num_requests_running",
              "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc", "tandem:gdn_state_slot_usage_perc",
              "tandem:inter_token_latency_seconds_bucket", "tandem:e2e_request_latency_seconds_bucket",
              "tandem:request_queue_time_seconds_bucket", "tandem:request_prefill_time_seconds_bucket",
              "tandem:request_decode_time_seconds_bucket", "tandem:spec_decode_num_drafts_total",
              "tandem:spec_decode_num_draft_tokens_total", "tandem:spec_decode_num_accepted_tokens_total",
              "tandem:spec_decode_num_accepted_tokens_per_pos_total", "tandem:handoff_bytes_total",
              "tandem:handoff_seconds_bucket", "tandem:handoff_failures_total", "tandem:lease_expiries_total",
              "tandem:leases_active", "tandem:worker_healthy", "tandem:engine_step_seconds_sum"):
        assert n in names, n
    assert not any(n.endswith("_total_total") for n in names)
    assert all(n.startswith("tandem:") for n in names)


def _buckets(m: Metrics, name: str) -> list[float]:
    les = [float(lab["le"]) for n, lab, _ in samples(m) if n == name + "_bucket"]
    assert les[-1] == float("inf")
    return les[:-1]


def test_buckets_equal_vllm():
    m = Metrics("tiny-moe", "test", registry=CollectorRegistry())
    touch_everything(m)
    assert _buckets(m, "tandem:time_to_first_token_seconds") == VLLM_TTFT
    assert _buckets(m, "tandem:inter_token_latency_seconds") == VLLM_ITL
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds"):
        assert _buckets(m, "tandem:" + h) == VLLM_REQUEST, h


def test_labels_and_values():
    m = Metrics("qwen3.5", "decode-1", registry=CollectorRegistry())
    touch_everything(m)
    got = samples(m)
    for name, labels, _ in got:
        assert labels["model_name"] == "qwen3.5" and labels["worker"] == "decode-1", (name, labels)

    def value(name, **extra):
        (v,) = [v for n, lab, v in got if n == name and all(lab.get(k) == str(x) for k, x in extra.items())]
        return v

    assert value("tandem:request_success_total", finished_reason="stop") == 1
    assert value("tandem:spec_decode_num_accepted_tokens_total") == 5
    assert value("tandem:spec_decode_num_accepted_tokens_per_pos_total", position=0) == 3
    assert value("tandem:spec_decode_num_accepted_tokens_per_pos_total", position=1) == 2
    assert value("tandem:spec_decode_num_accepted_tokens_total") <= value("tandem:spec_decode_num_draft_tokens_total")
    assert value("tandem:handoff_bytes_total") == 1 << 20
    assert value("tandem:handoff_seconds_count") == 1
    assert value("tandem:handoff_failures_total", reason="transport") == 1
    assert value("tandem:worker_healthy", target_worker="prefill-0", role="prefill") == 1
    assert value("tandem:request_decode_time_seconds_sum") == 1.0
    assert value("tandem:engine_step_seconds_count", kind="mixed") == 1
    assert value("tandem:engine_step_seconds_sum", kind="mixed") == pytest.approx(0.08)
    assert value("tandem:engine_step_prompt_tokens_total", kind="mixed") == 1820
    m.remove_worker("prefill-0", "prefill")
    assert not [n for n, _, _ in samples(m) if n == "tandem:worker_healthy"]


def test_roles_precreate_only_their_series():
    router = Metrics("m", "router", registry=CollectorRegistry())
    names = {n for n, _, _ in samples(router)}
    assert "tandem:time_to_first_token_seconds_count" in names
    assert "tandem:kv_cache_usage_perc" not in names  # a router has no KV cache to report
    reasons = {lab["finished_reason"] for n, lab, _ in samples(router) if n == "tandem:request_success_total"}
    assert reasons == set(tm.FINISHED_REASONS)  # at zero from the start, so rate() sees the first request
    decode = Metrics("m", "tandem-decode-7c9f-x2", registry=CollectorRegistry())  # a pod name
    assert decode.role == "decode"
    names = {n for n, _, _ in samples(decode)}
    assert {"tandem:kv_cache_usage_perc", "tandem:spec_decode_num_drafts_total", "tandem:leases_active"} <= names
    assert "tandem:time_to_first_token_seconds_count" not in names
    kinds = {lab["kind"] for n, lab, _ in samples(decode) if n == "tandem:engine_step_seconds_count"}
    assert kinds == set(tm.STEP_KINDS)  # at zero from the start
    token_kinds = {lab["kind"] for n, lab, _ in samples(decode) if n == "tandem:engine_step_prompt_tokens_total"}
    assert token_kinds == set(tm.STEP_KINDS)
    assert "tandem:engine_step_seconds_count" not in {n for n, _, _ in samples(router)}
    with pytest.raises(ValueError):
        decode.request_success_total("finished")
    with pytest.raises(ValueError):
        decode.engine_step_seconds("verify")
    with pytest.raises(ValueError):
        decode.engine_step_prompt_tokens_total("verify")
    with pytest.raises(ValueError):
        Metrics("m", "x", registry=CollectorRegistry(), role="colocated")


def test_registries_are_separate():
    a = Metrics("m", "prefill-0")
    b = Metrics("m", "prefill-1")
    a.prompt_tokens_total.inc(7)
    assert a.registry is not b.registry
    assert [v for n, _, v in samples(b) if n == "tandem:prompt_tokens_total"] == [0]


def test_http_server_serves_this_registry():
    m = Metrics("m", "router", registry=CollectorRegistry())
    m.time_to_first_token_seconds.observe(0.1)
    server, _thread = m.start_http_server(0, "127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'tandem:time_to_first_token_seconds_count{model_name="m",worker="router"} 1.0' in body
    assert "python_gc_objects_collected_total" not in body  # not the global default registry
