"""Faults against `tandem serve` (worker processes under --restart-workers; two of a role where the fault needs
another worker to go on: two decode workers for a lost decode worker and failover, two prefill workers for a lost
prefill worker): kill -9 of a decode worker mid-stream and of a prefill worker mid-hand-off, a stalled hand-off,
client cancellations at every stage, and decode failover. Every scenario ends with nothing allocated anywhere
(workers and router)."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams, launch
from tandem.rpc import common_pb2

ENGINE = ["--model", "tiny-moe", "--dtype", "float32", "--num-speculative-tokens", "2", "--block-size", "4",
          "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
          "--restart-workers", "--poll-seconds", "0.5"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def router_running(c: Cluster) -> float:
    """The router's in-flight request gauge (tandem:num_requests_running) from its /metrics."""
    text = requests.get(f"http://{c.metrics[0]}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("tandem:num_requests_running{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def assert_all_free(c: Cluster) -> None:
    assert_idle(c)
    deadline = time.monotonic() + 10
    while router_running(c) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router_running(c) == 0


def wait_healthy(c: Cluster, address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(w.address == address and w.healthy for w in c.client.server_info().workers):
        assert time.monotonic() < deadline, f"{address} did not come back"
        time.sleep(0.2)


def prompts(n, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(*ENGINE, "--prefill-workers", "1", "--decode-workers", "2", "--lease-seconds", "10")
    yield c
    assert c.stop() == 0


@pytest.mark.parametrize("failures", [2, 3])
def test_restart_starts_a_worker_again_when_it_fails_to_start(monkeypatch, failures):
    """A restarted worker that exits before it is ready (a CPU suite run once saw it fail to bind its old port,
    still taken a moment after the kill) is started again on the same ports (gRPC, hand-off, metrics) and
    environment (the internal token), each failed start's process gone first; after RESTART_ATTEMPTS failed starts
    the error is passed on (and `tandem serve` stops)."""
    starts = []

    class FlakyChild:  # a real process that never announces; the first `failures` starts fail
        def __init__(self, name, argv, env=None):
            self.name, self.argv, self.env, self.fails = name, argv, env, len(starts) < failures
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            starts.append(self)

        def wait_announced(self, deadline):
            if self.fails:
                raise RuntimeError(f"{self.name} exited with code 1 before it was ready")
            return {}

    monkeypatch.setattr(launch, "Child", FlakyChild)
    monkeypatch.setattr(launch, "RESTART_PAUSE", 0.0)
    dead = FlakyChild("decode-0", ["decode-worker", "--port", "0", "--transfer-port", "0", "--metrics-port", "0"],
                      env={"TANDEM_INTERNAL_TOKEN": "t"})
    starts.clear()
    ann = {"grpc": "127.0.0.1:4101", "transfer": "127.0.0.1:4102", "metrics": "127.0.0.1:4103"}
    try:
        if failures < launch.RESTART_ATTEMPTS:
            new = launch._restart(dead, ann)
            assert new is starts[-1] and len(starts) == failures + 1 and new.proc.poll() is None
        else:
            with pytest.raises(RuntimeError, match="before it was ready"):
                launch._restart(dead, ann)
            assert len(starts) == launch.RESTART_ATTEMPTS
        assert all(s.argv == ["decode-worker", "--port", "4101", "--transfer-port", "4102", "--metrics-port", "4103"]
                   and s.env == {"TANDEM_INTERNAL_TOKEN": "t"} for s in starts)
        assert all(s.proc.returncode is not None for s in starts[:failures])  # killed and reaped
    finally:
        for child in [dead, *starts]:
            child.proc.kill()
            child.proc.wait()


def test_kill_decode_worker_mid_stream(cluster):
    c = cluster
    n = 8
    started = threading.Barrier(n + 1)
    results, killed_at = [None] * n, [0.0]

    def run(i):
        call = c.client.generate(prompts(n)[i], SamplingParams(max_tokens=300, **GREEDY), timeout=120)
        got, waited = 0, False
        try:
            for m in call:
                got += len(m.token_ids)
                if got >= 3 and not waited:
                    waited = True
                    started.wait(60)
            results[i] = ("ok", got, time.monotonic())
        except grpc.RpcError as e:
            results[i] = (e.code(), got, time.monotonic())

    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(run, i) for i in range(n)]
        started.wait(60)  # every stream is decoding
        victim = c.workers["decode-0"]
        victim_metrics = dict(zip(["router", *c.workers], c.metrics))["decode-0"]
        os.kill(c.pids["decode-0"], signal.SIGKILL)
        killed_at[0] = time.monotonic()
        # meanwhile new requests go to the healthy worker and succeed
        during = [c.client.generate_unary(p, SamplingParams(max_tokens=8, **GREEDY), timeout=60)
                  for p in prompts(6, seed=11)]
        for f in futs:
            f.result()
    failed = [r for r in results if r[0] != "ok"]
    assert failed and all(r[0] == grpc.StatusCode.UNAVAILABLE for r in failed), results
    latency = max(r[2] - killed_at[0] for r in failed)
    assert latency < 5.0, latency
    assert all(r[1] == 300 for r in results if r[0] == "ok")  # the other worker's streams were untouched
    assert all(len(o.token_ids) == 8 for o in during)
    print(f"\nkill decode: {n} streams, {len(failed)} UNAVAILABLE (max {latency:.2f} s after the kill), "
          f"{n - len(failed)} completed; {len(during)}/{len(during)} new requests ok during the outage")

    c.wait_restarted("decode-0")
    wait_healthy(c, victim)
    # its metrics are where they were announced: the restarted process serves them on the same port
    assert 'worker="decode-0"' in requests.get(f"http://{victim_metrics}/metrics", timeout=10).text
    # the restarted worker takes work again: long requests spread over both, seen in its load
    calls = [c.client.generate(p, SamplingParams(max_tokens=300, **GREEDY), timeout=120) for p in prompts(6, 5)]
    used, deadline = False, time.monotonic() + 30
    while not used and time.monotonic() < deadline:
        used = any(w.address == victim and (w.load.running_requests or w.load.free_kv_blocks < w.load.total_kv_blocks)
                   for w in c.client.server_info().workers)
        time.sleep(0.1)
    assert used, "the restarted decode worker got no requests"
    assert all(sum(len(m.token_ids) for m in call) == 300 for call in calls)
    assert_all_free(c)


def test_cancellations_at_every_stage_leak_nothing(cluster):
    c = cluster
    rng = random.Random(0)
    outcomes = {"cancelled": 0, "finished": 0}

    def one(i):
        p = prompts(1, seed=100 + i)[0]
        call = c.client.generate(p, SamplingParams(max_tokens=rng.randrange(1, 200), **GREEDY), timeout=60)
        mode = i % 3
        if mode == 0:  # at a random time: before, during or after reserve / prefill / hand-off / decode
            threading.Timer(rng.uniform(0, 0.4), call.cancel).start()
        try:
            for k, _ in enumerate(call):
                if mode == 1 and k == 0 or mode == 2 and k == 2:  # right after the first token, or mid-decode
                    call.cancel()
            return "finished"
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e
            return "cancelled"

    n = 90
    with ThreadPoolExecutor(16) as pool:
        for r in pool.map(one, range(n)):
            outcomes[r] += 1
    print(f"\ncancellations: {n} requests, {outcomes}")
    assert outcomes["cancelled"] > n / 3
    assert_all_free(c)


def test_kill_prefill_worker_mid_handoff_retries_elsewhere():
    """prefill-0 stalls after the decode worker accepted its hand-off header (the one-time token is spent) and is
    killed there; the router gives that lease back, reserves anew and the other prefill worker completes it."""
    c = Cluster(*ENGINE, "--prefill-workers", "2", "--decode-workers", "1", "--lease-seconds", "20",
                "--inject-fault", "stall-handoff@0")
    try:
        ps = prompts(8, seed=21)
        params = SamplingParams(max_tokens=12, **GREEDY)
        with ThreadPoolExecutor(len(ps)) as pool:
            futs = [pool.submit(lambda p: (c.client.generate_unary(p, params, timeout=90), time.monotonic()), p)
                    for p in ps]
            time.sleep(1.5)
            stuck = sum(not f.done() for f in futs)  # the ones whose hand-off stalls on prefill-0
            assert stuck, "no request reached prefill-0"
            os.kill(c.pids["prefill-0"], signal.SIGKILL)
            killed = time.monotonic()
            outs = [f.result() for f in futs]
        llm = LLM(model="tiny-moe", dtype="float32", max_model_len=1024,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        want = llm.generate([{"prompt_token_ids": p} for p in ps], [params] * len(ps))
        for (o, _), w in zip(outs, want):
            assert list(o.token_ids) == w.outputs[0].token_ids
        retry = max(t for _, t in outs) - killed
        print(f"\nkill prefill: {len(ps)} requests, {stuck} stalled on the killed worker, all {len(ps)} succeeded "
              f"(equal to colocated), last {retry:.2f} s after the kill")
        c.wait_restarted("prefill-0")
        assert_all_free(c)
    finally:
        assert c.stop() == 0


def test_stalled_handoff_expires_the_lease_and_frees_both_sides():
    c = Cluster(*ENGINE, "--prefill-workers", "1", "--decode-workers", "1", "--lease-seconds", "1.5",
                "--inject-fault", "stall-handoff")
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.client.generate_unary([4, 5, 6, 7], SamplingParams(max_tokens=8, **GREEDY), timeout=60)
        took = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "hand-off" in e.value.details()
        assert_all_free(c)
        # a client that gives up during the stall frees everything too
        call = c.client.generate([8, 9, 10], SamplingParams(max_tokens=8, **GREEDY), timeout=60)
        threading.Timer(0.7, call.cancel).start()
        with pytest.raises(grpc.RpcError) as e2:
            list(call)
        assert e2.value.code() == grpc.StatusCode.CANCELLED
        assert_all_free(c)
        print(f"\nstalled hand-off: UNAVAILABLE after {took:.2f} s (2 attempts, lease 1.5 s each); cancel during "
              "the stall: freed")
    finally:
        assert c.stop() == 0


def test_decode_failover_continues_greedy_output_exactly():
    c = Cluster(*ENGINE, "--prefill-workers", "1", "--decode-workers", "2", "--lease-seconds", "10",
                "--decode-failover")
    try:
        ps = prompts(6, seed=31)
        params = SamplingParams(max_tokens=300, **GREEDY)
        n = len(ps)
        started = threading.Barrier(n + 1)

        def run(i):
            ids = []
            for k, m in enumerate(c.client.generate(ps[i], params, timeout=120)):
                ids.extend(m.token_ids)
                if k == 2:
                    started.wait()
                last = m
            return ids, last.finish_reason, last.completion_tokens

        with ThreadPoolExecutor(n) as pool:
            futs = [pool.submit(run, i) for i in range(n)]
            started.wait(60)
            deadline = time.monotonic() + 5
            while True:  # the router's view of the loads is up to one poll old
                loads = {w.address: w.load.running_requests for w in c.client.server_info().workers}
                on_victim = loads[c.workers["decode-0"]]
                if on_victim or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert on_victim, loads  # some streams do fail over
            os.kill(c.pids["decode-0"], signal.SIGKILL)
            outs = [f.result() for f in futs]
        llm = LLM(model="tiny-moe", dtype="float32", max_model_len=1024,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        want = llm.generate([{"prompt_token_ids": p} for p in ps], [params] * n)
        for (ids, reason, count), w in zip(outs, want):
            assert ids == w.outputs[0].token_ids and count == 300
            assert reason == common_pb2.FINISH_REASON_LENGTH
        print(f"\ndecode failover: {n} streams, {on_victim} on the killed decode worker, all {n} equal to colocated")
        c.wait_restarted("decode-0")
        assert_all_free(c)
    finally:
        assert c.stop() == 0


def router_gauge(c: Cluster, name: str) -> float:
    text = requests.get(f"http://{c.metrics[0]}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(f"tandem:{name}{{"))


def test_bounded_queue_refuses_with_a_retry_hint_and_sizes_are_limited():
    c = Cluster("--model", "tiny-moe", "--max-model-len", "1024", "--max-num-seqs", "2", "--max-queued-requests",
                "2", "--poll-seconds", "0.5")
    try:
        long = SamplingParams(max_tokens=900, **GREEDY)
        running = [c.client.generate([1, 2, 3, i], long, timeout=120) for i in range(2)]
        for call in running:
            next(iter(call))  # both decode seats taken
        queued = [c.client.generate([4, 5, 6, i], long, timeout=120) for i in range(2)]
        deadline = time.monotonic() + 20
        while router_gauge(c, "num_requests_waiting") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.client.generate_unary([7, 8, 9], long, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.value.details()
        assert dict(e.value.trailing_metadata())["retry-after-ms"].isdigit()
        assert time.monotonic() - t0 < 2  # refused at once, not parked
        r = requests.post(f"http://{c.http}/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4},
                          timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, (r.status_code, r.text)
        for call in running + queued:
            call.cancel()
        # sizes: a gRPC message over --max-request-bytes (8 MiB) and an HTTP body over it are refused, not served
        with pytest.raises(grpc.RpcError) as e:
            c.client.generate_unary([70000] * (3 << 20), SamplingParams(max_tokens=1), timeout=30)  # 9 MiB
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = requests.post(f"http://{c.http}/v1/completions", data=b"{" + b" " * (9 << 20) + b"}",
                          headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 413
        with pytest.raises(grpc.RpcError) as e:  # within the message limit but over max_model_len
            c.client.generate_unary([1] * 2000, SamplingParams(max_tokens=1), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert_all_free(c)
    finally:
        assert c.stop() == 0
