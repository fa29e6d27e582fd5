"""Colocated serving: `tandem serve --prefill-workers 0` (router + decode worker processes over loopback; the decode
worker prefills the requests it leased itself, no hand-off) against the colocated `LLM` as the oracle, plus
streaming (gRPC and HTTP), abort and cancel leaving nothing allocated, and the decode worker's Prefill contract
(unknown lease, wrong token, reused lease; in process: a lease that expires while prefilling, a cancelled Prefill)."""

import argparse
import json
import queue
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, assert_idle, cancel_at_three_stages, long_request
from decode_worker.server import DecodeWorker
from tandem import LLM, SamplingParams
from tandem.engine.engine import Engine
from tandem.model.source import load_model
from tandem.metrics import Metrics
from tandem.rpc import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import with_internal_token
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.server import make_channel
from tandem.worker_setup import DEFAULT_MODEL, add_engine_args, engine_config

K = 2
MODEL = DEFAULT_MODEL  # the trained tandem-tiny: its MTP drafts are really accepted
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-speculative-tokens", str(K), "--block-size", "4",
          "--max-model-len", "1024", "--max-num-seqs", "6", "--max-num-batched-tokens", "64"]


def workload(n=8):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 512, (m,), generator=g).tolist() for m in lengths]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0) for m in torch.randint(1, 24, (n,), generator=g)]
    return prompts, params


@pytest.fixture(scope="module")
def oracle():
    """Colocated-engine outputs for the workload: {tuple(prompt): (token ids, finish reason)}."""
    prompts, params = workload()
    llm = LLM(model=MODEL, dtype="float32", max_model_len=1024,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return {tuple(p): (o.outputs[0].token_ids, o.outputs[0].finish_reason) for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(*ENGINE, "--prefill-workers", "0", "--decode-workers", "1")
    try:
        yield c
    finally:
        assert c.stop() == 0


def scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if len(s.labels) == 2}


def stream(client, prompt, params):
    msgs = list(client.generate(prompt, params, timeout=120))
    assert msgs and len(msgs[0].token_ids) == 1  # the first token is the Prefill answer alone
    assert all(m.finish_reason == 0 for m in msgs[:-1]) and msgs[-1].finish_reason != 0
    assert [m.completion_tokens for m in msgs] == list(torch.tensor([len(m.token_ids) for m in msgs]).cumsum(0))
    ids = [t for m in msgs for t in m.token_ids]
    reason = common_pb2.FinishReason.Name(msgs[-1].finish_reason).removeprefix("FINISH_REASON_").lower()
    return ids, reason, len(msgs)


def test_concurrent_requests_equal_colocated(cluster, oracle):
    info = cluster.client.server_info()
    assert info.mode == "colocated" and not info.prefill_workers and len(info.decode_workers) == 1
    assert [w.role for w in info.workers] == ["decode"]
    before = scrape(cluster.metrics[1])
    prompts, params = workload()
    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: more than max_num_seqs
        results = list(pool.map(lambda pp: stream(cluster.client, *pp), zip(prompts, params)))
    for p, (ids, reason, _) in zip(prompts, results):
        assert (ids, reason) == oracle[tuple(p)], p
    assert any(n < len(ids) for ids, _, n in results)  # real acceptance: some messages carry several tokens
    assert_idle(cluster)
    after = scrape(cluster.metrics[1])  # the decode worker's: it counts the prompts it prefilled
    assert after["tandem:prompt_tokens_total"] - before.get("tandem:prompt_tokens_total", 0) == sum(map(len, prompts))
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] == \
        sum(len(ids) for ids, _, _ in results)
    assert after["tandem:request_prefill_time_seconds_count"] - \
        before.get("tandem:request_prefill_time_seconds_count", 0) == len(prompts)
    assert after["tandem:leases_active"] == 0 and after["tandem:handoff_bytes_total"] == 0


def test_unary_and_http_stream(cluster, oracle):
    prompts, params = workload()
    out = cluster.client.generate_unary(prompts[0], params[0], timeout=60)
    assert list(out.token_ids) == oracle[tuple(prompts[0])][0]
    body = {"prompt": prompts[1], "max_tokens": params[1].max_tokens, "temperature": 0.0, "stream": True}
    with requests.post(f"http://{cluster.http}/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len(b"data: "):] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == oracle[tuple(prompts[1])][1]
    assert_idle(cluster)


def test_abort_mid_stream_frees_everything(cluster):
    it = iter(cluster.client.generate(*long_request(), request_id="to-abort", timeout=120))
    first = [next(it), next(it)]
    assert cluster.client.stub.Abort(router_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    rest = list(it)
    assert rest and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in first + rest) < 900
    assert_idle(cluster)
    assert scrape(cluster.metrics[1])["tandem:leases_active"] == 0


def test_client_cancel_frees_everything(cluster):
    cancel_at_three_stages(cluster)


def test_prefill_rpc_on_the_decode_worker(cluster):
    channel = with_internal_token(make_channel(cluster.workers["decode-0"], None), cluster.internal_token)
    try:
        prefill, decode = worker_pb2_grpc.PrefillWorkerStub(channel), worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            prefill.Prefill(worker_pb2.PrefillRequest(request_id="x", lease=worker_pb2.Lease(lease_id="nope")),
                            timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        lease = decode.Reserve(worker_pb2.ReserveRequest(request_id="direct", prompt_token_ids=[3, 4, 5],
                                                         sampling=sampling_to_proto(sp)), timeout=10)
        req = worker_pb2.PrefillRequest(request_id="direct", prompt_token_ids=[3, 4, 5],
                                        sampling=sampling_to_proto(sp), lease=lease)
        forged = worker_pb2.Lease()
        forged.CopyFrom(lease)
        forged.transfer_token = b"\0" * 16
        with pytest.raises(grpc.RpcError) as e:
            prefill.Prefill(worker_pb2.PrefillRequest(request_id="direct", lease=forged), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        first = prefill.Prefill(req, timeout=30)
        assert first.finish_reason == 0 and first.handoff_bytes == 0
        with pytest.raises(grpc.RpcError) as e:  # the lease is spent
            prefill.Prefill(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        msgs = list(decode.Decode(worker_pb2.DecodeRequest(request_id="direct", lease_id=lease.lease_id),
                                  timeout=30))
        assert 1 + sum(len(m.token_ids) for m in msgs) == 6
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        want = cluster.client.generate_unary([3, 4, 5], sp, timeout=30).token_ids
        assert [first.first_token_id] + [t for m in msgs for t in m.token_ids] == list(want)
    finally:
        channel.close()
    assert_idle(cluster)


# ---- in process: what the multi-process tests cannot time ------------------------------------------------------
class _Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(code, details)
        self.code = code


class _Context:
    """Enough of grpc.ServicerContext for one handler call; `end()` is the RPC ending (cancel)."""

    def __init__(self):
        self.active, self.callbacks = True, []

    def abort(self, code, details):
        raise _Aborted(code, details)

    def is_active(self):
        return self.active

    def add_callback(self, fn):
        self.callbacks.append(fn)
        return True

    def time_remaining(self):
        return None

    def end(self):
        self.active = False
        for fn in self.callbacks:
            fn()


def _engine(*flags) -> Engine:
    """An engine in this process, configured as the cluster's workers are (ENGINE, then `flags` overriding it)."""
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ecfg = engine_config(ap.parse_args([*ENGINE, "--device", "cpu", *flags]))
    cfg, model, _ = load_model(MODEL, "cpu", torch.float32)
    return Engine(cfg, model, ecfg)


@pytest.fixture(scope="module")
def slow_worker():
    """A decode worker whose prompts are prefilled in many slow chunks (4 tokens a step, 0.1 s per step)."""
    engine = _engine("--max-num-seqs", "4", "--max-model-len", "256", "--max-num-batched-tokens", "4")
    step = engine.step

    def slow_step():
        time.sleep(0.1)
        return step()

    engine.step = slow_step
    worker = DecodeWorker(engine, "fp", "127.0.0.1", 0, "127.0.0.1", lease_seconds=1.0,
                          metrics=Metrics("m", "decode-0")).start()
    yield worker
    worker.stop()


GREEDY_8 = SamplingParams(max_tokens=8, temperature=0.0)


def _reserve(worker, rid, prompt=tuple(range(2, 82)), params=GREEDY_8):
    return worker.Reserve(worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=list(prompt),
                                                    sampling=sampling_to_proto(params)), _Context())


def _assert_nothing_held(worker):
    def held(e):
        return (len(e.scheduler.running), len(e.scheduler.reserved), e.pools.blocks.num_used, e.pools.slots.num_used)
    deadline = time.monotonic() + 5
    while worker.loop.call(held) != (0, 0, 0, 0) or worker.busy():
        assert time.monotonic() < deadline, (worker.loop.call(held), worker.busy())
        time.sleep(0.05)


def test_lease_expiring_while_prefilling_frees_it(slow_worker):
    lease = _reserve(slow_worker, "slow")
    expired = slow_worker.metrics.lease_expiries_total._value.get()
    with pytest.raises(_Aborted) as e:  # 20 chunks of 0.1 s, the lease lasts 1 s
        slow_worker.Prefill(worker_pb2.PrefillRequest(request_id="slow", lease=lease), _Context())
    assert e.value.code == grpc.StatusCode.ABORTED  # not renewed: retried with a new lease
    assert slow_worker.metrics.lease_expiries_total._value.get() == expired + 1
    _assert_nothing_held(slow_worker)


def test_cancelled_prefill_frees_it(slow_worker):
    lease = _reserve(slow_worker, "cancelled")
    ctx, out = _Context(), []
    t = threading.Thread(target=lambda: out.append(slow_worker.Prefill(
        worker_pb2.PrefillRequest(request_id="cancelled", lease=lease), ctx)))
    t.start()
    deadline = time.monotonic() + 0.5  # well before the lease expires
    while slow_worker.loop.call(lambda e: e.scheduler.reserved):  # until it is in the batch, prefilling
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert slow_worker._by_lease[lease.lease_id].stage == "prefilling"
    ctx.end()
    t.join(5)
    assert not t.is_alive() and out[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    _assert_nothing_held(slow_worker)


def test_stream_interval_holds_tokens_back(oracle):
    """--stream-interval 5: every message but a request's last carries at least 5 tokens, and the tokens are the
    colocated engine's."""
    with pytest.raises(ValueError, match="stream_interval"):
        DecodeWorker(_engine(), "fp", "127.0.0.1", 0, "127.0.0.1", stream_interval=0)
    worker = DecodeWorker(_engine(), "fp", "127.0.0.1", 0, "127.0.0.1", stream_interval=5).start()
    try:
        held_back = 0
        for i, (prompt, params) in enumerate(zip(*workload())):
            rid = f"interval-{i}"
            lease, first = _prefilled(worker, rid, prompt, params)
            msgs = [] if first.finish_reason else list(worker.Decode(
                worker_pb2.DecodeRequest(request_id=rid, lease_id=lease.lease_id), _Context()))
            assert all(len(m.token_ids) >= 5 for m in msgs[:-1]), [len(m.token_ids) for m in msgs]
            held_back += sum(len(m.token_ids) >= 5 for m in msgs)
            reason = (msgs[-1] if msgs else first).finish_reason
            ids = [first.first_token_id] + [t for m in msgs for t in m.token_ids]
            name = common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
            assert (ids, name) == oracle[tuple(prompt)]
        assert held_back >= 4  # the workload has requests long enough to hold tokens back
        _assert_nothing_held(worker)
    finally:
        worker.stop()


@pytest.fixture
def fast_worker():
    worker = DecodeWorker(_engine(), "fp", "127.0.0.1", 0, "127.0.0.1").start()
    yield worker
    worker.stop()


def _prefilled(worker, rid, prompt, params):
    lease = _reserve(worker, rid, prompt, params)
    first = worker.Prefill(worker_pb2.PrefillRequest(request_id=rid, lease=lease), _Context())
    return lease, first


def test_attach_streams_many_requests_a_step_at_a_time(fast_worker, oracle):
    """One Attach stream for several requests: messages carry several requests' tokens, each request gets the
    colocated engine's tokens, and a lease that is not open comes back as that request's NOT_FOUND entry."""
    prompts, params = workload()
    long_ones = sorted(range(len(params)), key=lambda i: -params[i].max_tokens)[:3]  # the longest overlap most
    requests, ctx = queue.SimpleQueue(), _Context()
    stream = fast_worker.Attach(iter(requests.get, None), ctx)
    want, got, firsts = {}, {}, {}
    for i in long_ones:
        lease, first = _prefilled(fast_worker, f"many-{i}", prompts[i], params[i])
        want[f"many-{i}"], firsts[f"many-{i}"] = oracle[tuple(prompts[i])], first.first_token_id
        requests.put(worker_pb2.DecodeRequest(request_id=f"many-{i}", lease_id=lease.lease_id))
    requests.put(worker_pb2.DecodeRequest(request_id="no-such", lease_id="nope"))
    shared, errors, done = 0, {}, set()
    while len(done) < len(long_ones) or not errors:
        batch = next(stream)
        shared += len({o.request_id for o in batch.outputs if o.token_ids}) > 1
        for o in batch.outputs:
            if o.error_code:
                errors[o.request_id] = grpc.StatusCode.NOT_FOUND.value[0] == o.error_code
                continue
            got.setdefault(o.request_id, [firsts[o.request_id]]).extend(o.token_ids)
            if o.finish_reason:
                done.add(o.request_id)
                got[o.request_id] = (got[o.request_id],
                                     common_pb2.FinishReason.Name(o.finish_reason).removeprefix("FINISH_REASON_").lower())
    assert errors == {"no-such": True}
    assert got == want
    assert shared > 0  # a step's tokens for several requests went out as one message
    ctx.end()
    _assert_nothing_held(fast_worker)


def test_attach_stream_ending_aborts_its_requests(fast_worker):
    """The router's stream goes away mid-request: the worker aborts what it had attached and frees it all."""
    lease, first = _prefilled(fast_worker, "orphan", list(range(2, 30)), SamplingParams(max_tokens=500,
                                                                                        temperature=0.0))
    assert not first.finish_reason
    requests, ctx = queue.SimpleQueue(), _Context()
    stream = fast_worker.Attach(iter(requests.get, None), ctx)
    requests.put(worker_pb2.DecodeRequest(request_id="orphan", lease_id=lease.lease_id))
    assert any(o.request_id == "orphan" and o.token_ids for o in next(stream).outputs)
    ctx.end()
    _assert_nothing_held(fast_worker)
