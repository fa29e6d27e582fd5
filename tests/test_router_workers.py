"""The router's worker pool: DNS discovery, health from polling, and placement order."""

import socket

from router.workers import Worker, WorkerPool, resolve
from tandem.rpc import common_pb2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dns_name_resolves_to_one_address_per_host():
    port = free_port()
    got = resolve(f"localhost:{port}")
    assert f"127.0.0.1:{port}" in got and all(a.endswith(f":{port}") for a in got)
    assert resolve("no-such-host.invalid:80") == []


def test_unreachable_worker_is_unhealthy_and_not_a_candidate():
    pool = WorkerPool("decode", [f"127.0.0.1:{free_port()}"], None, poll_seconds=0.2).start()  # polls once at once
    (w,) = pool.all()
    assert not w.healthy and pool.candidates() == []
    pool.stop()


def _worker(name, role, **load):
    return Worker(name, role, stub=None, channel=None, healthy=True, load=common_pb2.Load(**load))


def test_placement_prefers_free_capacity_and_short_queues():
    pool = WorkerPool("decode", ["unused:1"], None)
    pool.workers = {
        "full": _worker("full", "decode", free_kv_blocks=1, total_kv_blocks=100, free_state_slots=50,
                        total_state_slots=100, running_requests=2),
        "busy": _worker("busy", "decode", free_kv_blocks=90, total_kv_blocks=100, free_state_slots=90,
                        total_state_slots=100, running_requests=20),
        "idle": _worker("idle", "decode", free_kv_blocks=90, total_kv_blocks=100, free_state_slots=90,
                        total_state_slots=100, running_requests=1),
    }
    assert [w.address for w in pool.candidates()] == ["idle", "busy", "full"]
    prefill = WorkerPool("prefill", ["unused:1"], None)
    prefill.workers = {"a": _worker("a", "prefill", queued_prompt_tokens=5000),
                       "b": _worker("b", "prefill", queued_prompt_tokens=10)}
    assert [w.address for w in prefill.candidates()] == ["b", "a"]


def test_placement_prefers_a_worker_whose_free_tokens_hold_the_lease():
    pool = WorkerPool("decode", ["unused:1"], None)
    pool.workers = {  # "roomy" is the busier, but only it has room for a 500-token lease
        "tight": _worker("tight", "decode", free_kv_blocks=20, total_kv_blocks=100, free_kv_tokens=320,
                         total_kv_tokens=1600, free_state_slots=9, total_state_slots=10),
        "roomy": _worker("roomy", "decode", free_kv_blocks=50, total_kv_blocks=1000, free_kv_tokens=800,
                         total_kv_tokens=16000, free_state_slots=5, total_state_slots=10, running_requests=5),
    }
    assert [w.address for w in pool.candidates(500)] == ["roomy", "tight"]
    assert [w.address for w in pool.candidates(100)] == ["tight", "roomy"]


def test_router_without_max_model_len_takes_the_shortest_a_healthy_worker_reports():
    from router.server import Router
    from tandem.model.source import model_config

    cfg = model_config("tiny-moe")
    decode, prefill = WorkerPool("decode", ["unused:1"], None), WorkerPool("prefill", ["unused:1"], None)
    router = Router(cfg, "m", None, 2, prefill, decode)
    assert router.max_model_len == cfg.max_position_embeddings  # nothing reported yet: the model's own
    decode.workers = {"a": _worker("a", "decode", max_model_len=4096), "b": _worker("b", "decode", max_model_len=2048)}
    prefill.workers = {"p": _worker("p", "prefill", max_model_len=3000)}
    assert router.max_model_len == 2048
    decode.workers["b"].healthy = False
    assert router.max_model_len == 3000
    assert Router(cfg, "m", 1000, 2, prefill, decode).max_model_len == 1000  # --max-model-len wins
