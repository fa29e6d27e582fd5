"""Admission that cannot strand work, against `tandem serve` (tandem-tiny on the CPU, 1 prefill + 1 decode worker,
1 s leases): queued requests outlive many lease lengths and still succeed (the router renews their leases, also
when colocated), a full prefill queue refuses at once with RESOURCE_EXHAUSTED and a retry hint, requests whose
deadline passed while queued are never prefilled, and the engines' gauges drop to zero when an abort empties them.
"""

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, assert_idle
from router.server import LEASE_ATTEMPTS, Router, _Active
from router.workers import Worker
from tandem import SamplingParams
from tandem.rpc import worker_pb2

LONG = 1500  # prompt tokens: ~2.5 s of prefill each on a 2-core CPU
QUEUE = 4 * LONG  # --max-queued-prompt-tokens: four long prompts wait, a fifth is refused
FLAGS = ["--lease-seconds", "1", "--max-num-batched-tokens", "512", "--poll-seconds", "0.5", "--log-level", "ERROR"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 4000) for _ in range(n)]


def scrape(address: str) -> dict:
    """{sample name: value summed over its labels} of one process's /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def outcome(fn):
    """(status code or "ok", seconds, trailing metadata of an error)."""
    t0 = time.monotonic()
    try:
        fn()
        return "ok", time.monotonic() - t0, {}
    except grpc.RpcError as e:
        return e.code(), time.monotonic() - t0, dict(e.trailing_metadata() or ())


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("--prefill-workers", "1", "--decode-workers", "1", "--max-queued-prompt-tokens", str(QUEUE), *FLAGS)
    yield c
    assert c.stop() == 0


def test_queued_requests_outlive_their_lease_and_a_full_queue_refuses_at_once(cluster):
    """Six long prompts at once: four fit the prefill queue and wait there several lease lengths (renewed), all
    served; the rest are refused within moments with RESOURCE_EXHAUSTED and `retry-after-ms`."""
    params = SamplingParams(max_tokens=4, **GREEDY)
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: outcome(lambda: cluster.client.generate_unary(
            prompt(LONG, i), params, timeout=120)), range(6)))
    served = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(served) + len(refused) == 6, results
    assert len(served) >= 4 and refused, results
    assert max(t for _, t, _ in served) > 3.0, results  # the last one served waited for several 1 s leases
    assert all(t < 3.0 and "retry-after-ms" in md for _, t, md in refused), results
    after = scrape(cluster.metrics[2])
    assert after["tandem:lease_expiries_total"] == 0
    assert_idle(cluster)


def test_requests_past_their_deadline_are_never_prefilled(cluster):
    """Long prompts whose deadlines (50-250 ms) pass while they wait: the prefill worker computes at most the step
    that was under way when they came, and a short request sent next is answered promptly."""
    computed = "tandem:engine_step_prompt_tokens_total"
    before = scrape(cluster.metrics[1])[computed]
    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(lambda i: outcome(lambda: cluster.client.generate_unary(
            prompt(LONG, 100 + i), SamplingParams(max_tokens=4, **GREEDY), timeout=0.05 + 0.02 * i)), range(12)))
    assert {r[0] for r in results} <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}, \
        results
    t0 = time.monotonic()
    out = cluster.client.generate_unary([5, 6, 7, 8], SamplingParams(max_tokens=2, **GREEDY), timeout=60)
    took = time.monotonic() - t0
    assert len(out.token_ids) == 2
    assert_idle(cluster)
    spent = scrape(cluster.metrics[1])[computed] - before - 4
    # the queue admits 4 x 1500 tokens; only steps begun before the deadlines passed (512 tokens each) may run
    assert spent <= 3 * 512, spent
    assert took < 10.0, took


def _wait_metric(address: str, name: str, pred, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = scrape(address).get(name, 0.0)
        if pred(value):
            return value
        assert time.monotonic() < deadline, (name, value)
        time.sleep(0.05)


def test_gauges_drop_when_an_abort_empties_the_engine(cluster):
    """A request cancelled while prefilling, then one cancelled while decoding: each worker's gauges read 0 once
    GetLoad does, though no engine step ran after the abort."""
    prefill, decode = cluster.metrics[1], cluster.metrics[2]
    call = cluster.client.generate(prompt(3 * 512, 7), SamplingParams(max_tokens=4, **GREEDY), timeout=120)
    threading.Thread(target=lambda: list(_swallow(call)), daemon=True).start()
    _wait_metric(prefill, "tandem:kv_cache_usage_perc", lambda v: v > 0)
    call.cancel()
    call = cluster.client.generate([5, 6, 7], SamplingParams(max_tokens=2000, **GREEDY), timeout=120)
    it = iter(call)
    next(it)
    _wait_metric(decode, "tandem:num_requests_running", lambda v: v == 1)
    call.cancel()
    assert_idle(cluster)
    for address in (prefill, decode):
        m = scrape(address)
        gauges = {k: m[k] for k in ("tandem:num_requests_running", "tandem:num_requests_waiting",
                                    "tandem:kv_cache_usage_perc", "tandem:gdn_state_slot_usage_perc")}
        assert set(gauges.values()) == {0.0}, (address, gauges)


def _swallow(call):
    try:
        yield from call
    except grpc.RpcError:
        pass


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name


class _Rpc:
    """A worker method: `answer(request)` returns or raises; counts its calls; `.future` as grpc's."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def __call__(self, request, timeout=None):
        self.calls += 1
        return self.answer(request)

    def future(self, request, timeout=None):
        rpc = self

        class Done:
            @staticmethod
            def result(timeout=None):
                return rpc(request)
        return Done()


class _Context:
    def __init__(self):
        self.trailing = ()

    def time_remaining(self):
        return None

    def is_active(self):
        return True

    def set_trailing_metadata(self, md):
        self.trailing = md

    def abort(self, code, details):
        raise _RpcError(code)


def _router(prefill_answers, admit=lambda r: worker_pb2.AdmitResponse()):
    """A Router over one fake prefill and one fake decode worker; Prefill answers from `prefill_answers` in turn."""
    answers = iter(prefill_answers)

    def prefill(request):
        answer = next(answers)
        if isinstance(answer, grpc.StatusCode):
            raise _RpcError(answer)
        return answer

    leases = iter(range(100))
    decode = Worker("d", "decode", type("Stub", (), {})(), None, healthy=True)
    decode.stub.Reserve = _Rpc(lambda r: worker_pb2.Lease(request_id=r.request_id, lease_id=str(next(leases))))
    decode.stub.Abort = _Rpc(lambda r: worker_pb2.WorkerAbortResponse(found=True))
    p = Worker("p", "prefill", type("Stub", (), {})(), None, healthy=True)
    p.stub.Admit, p.stub.Prefill = _Rpc(admit), _Rpc(prefill)

    class Pool:
        def __init__(self, w):
            self.w = w

        def candidates(self, tokens=0, route=None):
            return [self.w]

        def all(self):
            return [self.w]

        def placed(self, w, route, tokens=None):  # what routing learns: not under test here
            pass

        def count(self, w, route):
            pass

    return Router(None, "m", 4096, 0, Pool(p), Pool(decode)), p, decode


def test_a_request_whose_lease_expired_is_retried_with_a_new_lease():
    """The hand-off refused with ABORTED (the lease expired before it): each time the lease is given back and the
    request starts over on a new one; after LEASE_ATTEMPTS leases, UNAVAILABLE with a retry hint, not a 500."""
    first = worker_pb2.PrefillResponse(first_token_id=7)
    router, p, d = _router([grpc.StatusCode.ABORTED, grpc.StatusCode.ABORTED, first])
    lease, got = router._start(_Active("r"), [1, 2, 3], SamplingParams(max_tokens=4), _Context())
    assert got.first_token_id == 7 and lease.lease_id == "2"
    assert d.stub.Reserve.calls == 3 and d.stub.Abort.calls == 2  # the two expired leases were given back

    router, p, d = _router([grpc.StatusCode.ABORTED] * LEASE_ATTEMPTS)
    ctx = _Context()
    with pytest.raises(_RpcError) as e:
        router._start(_Active("r"), [1, 2, 3], SamplingParams(max_tokens=4), ctx)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "retry-after-ms" in dict(ctx.trailing)
    assert d.stub.Reserve.calls == LEASE_ATTEMPTS


def test_a_full_prefill_queue_is_refused_before_any_lease():
    def full(request):
        raise _RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)

    router, p, d = _router([], admit=full)
    ctx = _Context()
    with pytest.raises(_RpcError) as e:
        router._start(_Active("r"), [1, 2, 3], SamplingParams(max_tokens=4), ctx)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after-ms" in dict(ctx.trailing)
    assert d.stub.Reserve.calls == 0 and p.stub.Prefill.calls == 0


def test_colocated_queued_requests_outlive_their_lease():
    """Colocated (no prefill workers): long prompts queued in the decode worker's own engine wait several lease
    lengths (renewed) and are all served."""
    c = Cluster("--prefill-workers", "0", "--decode-workers", "1", *FLAGS, "--lease-seconds", "0.5")
    try:
        params = SamplingParams(max_tokens=4, **GREEDY)
        with ThreadPoolExecutor(3) as ex:
            results = list(ex.map(lambda i: outcome(lambda: c.client.generate_unary(
                prompt(LONG, 200 + i), params, timeout=120)), range(3)))
        assert [r[0] for r in results] == ["ok"] * 3, results
        # three leases at least (0.5 s each): the three prompts' prefill takes ~2.5 s here, ~1.8 s on a quiet machine
        assert max(t for _, t, _ in results) > 1.5, results
        assert scrape(c.metrics[1])["tandem:lease_expiries_total"] == 0
        assert_idle(c)
    finally:
        assert c.stop() == 0
