"""Tensor-parallel serving workers on the CPU (two ranks over gloo): `tandem serve --tensor-parallel-size 2`,
disaggregated (tcp hand-off) and colocated, and a TP = 2 prefill worker handing off to a TP = 1 decode worker,
all give the one-rank greedy fp32 output; a hand-off's state is the full model's whatever either side's TP size;
no rank outlives its worker.

The model is the trained tandem-tiny (2 KV heads, 2 GDN key / 4 value heads, 16 experts: all split in two).
"""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import torch

from cluster import Cluster, assert_idle
from tandem import LLM, SamplingParams
from tandem.cache.handoff import gather_state
from tandem.client import TandemClient
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.llm import build_model
from tandem.launch import Child, _stop_all
from tandem.rpc.auth import INTERNAL_TOKEN_ENV
from tandem.rpc.convert import finish_reason_name
from tandem.worker_setup import DEFAULT_MODEL

MODEL, K, TOL = DEFAULT_MODEL, 2, 1e-5
ENGINE = ["--model", MODEL, "--dtype", "float32", "--device", "cpu", "--num-speculative-tokens", str(K),
          "--block-size", "4", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
COMMON = ["--host", "127.0.0.1", "--port", "0", "--drain-timeout", "5"]
LENGTHS, MAX_NEW = [1, 7, 13, 26, 5, 18], [10, 6, 12, 8, 1, 9]


def workload():
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
    return prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_NEW]


@pytest.fixture(scope="module")
def oracle():
    """One-rank outputs of the workload: {tuple(prompt): (token ids, finish reason)}."""
    prompts, params = workload()
    llm = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return {tuple(p): (o.outputs[0].token_ids, o.outputs[0].finish_reason) for p, o in zip(prompts, outs)}


def run_workload(client, oracle):
    """Every request at once (more than max_num_seqs); each must equal the one-rank output."""
    prompts, params = workload()

    def one(pp):
        out = client.generate_unary(*pp, timeout=120)
        return list(out.token_ids), finish_reason_name(out.finish_reason)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, zip(prompts, params)))
    for p, got in zip(prompts, results):
        assert got == oracle[tuple(p)], p


def followers_of(pids):
    """The tensor-parallel ranks (spawned children, not multiprocessing's resource tracker) of these processes."""
    out = []
    for pid in pids:
        out += [c for c in psutil.Process(pid).children() if any("spawn_main" in a for a in c.cmdline())]
    return out


def assert_gone(procs, timeout=15.0):
    deadline = time.monotonic() + timeout
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, [p.pid for p in alive]


# ---- in one process: the engines' side of the hand-off ------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    """One-rank and two-rank prefill-only and decode engines of the same weights; the ranks stop at the end."""
    ecfg = EngineConfig(block_size=4, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=16,
                        num_speculative_tokens=K, dtype="float32", device="cpu")
    cfg, one, _ = build_model(MODEL, ecfg)
    _, prefill_two, _ = build_model(MODEL, ecfg, tensor_parallel_size=2)
    _, decode_two, _ = build_model(MODEL, ecfg, tensor_parallel_size=2)
    made = {"prefill": {1: Engine(cfg, one, ecfg, prefill_only=True), 2: Engine(cfg, prefill_two, ecfg, True)},
            "decode": {1: Engine(cfg, one, ecfg), 2: Engine(cfg, decode_two, ecfg)}}
    yield made
    procs = [p for m in (prefill_two, decode_two) for p in m._followers.procs]
    prefill_two.shutdown()
    decode_two.shutdown()
    assert not any(p.is_alive() for p in procs)


def prefilled(engine, rid, prompt, params):
    """The request's hand-off, or None when its first token already finished it."""
    engine.add_request(rid, prompt, params)
    for _ in range(100):
        if engine.step():
            return None
        handed = engine.take_prefilled()
        if handed:
            return handed[0]
    raise AssertionError("prompt not prefilled")


def test_handoff_state_is_the_one_rank_state(engines):
    """gather_state on two ranks gives the one-rank names, shapes and dtypes, and values within fp32 all-reduce
    rounding (a head put in the wrong place would be off by far more); layer 0, a GDN layer with no all-reduce
    before it, bit for bit."""
    prompts, params = workload()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        one = prefilled(engines["prefill"][1], f"s{i}", p, sp)
        two = prefilled(engines["prefill"][2], f"s{i}", p, sp)
        assert (one is None) == (two is None)
        if one is None:
            continue  # max_tokens=1: nothing to hand off
        assert [n for n, _ in one.state] == [n for n, _ in two.state]
        for (name, a), (_, b) in zip(one.state, two.state):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert (a - b).abs().max() <= TOL, name
            if name.startswith("layers.0."):
                assert torch.equal(a, b), name
        assert (one.seq.output_token_ids, one.seq.drafts) == (two.seq.output_token_ids, two.seq.drafts)
    for e in engines["prefill"].values():
        assert e.pools.blocks.num_used == 0 and e.pools.slots.num_used == 0


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_handoff_between_tensor_parallel_sizes(engines, oracle, prefill_tp, decode_tp):
    """The state of a prefill engine of either size installs into a decode engine of either size (scatter, then
    a gather of what was installed gives it back exactly) and decoding continues as on one rank."""
    prompts, params = workload()
    prefill, decode = engines["prefill"][prefill_tp], engines["decode"][decode_tp]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = f"h{prefill_tp}{decode_tp}-{i}"
        lease = decode.reserve(rid, p, sp)
        h = prefilled(prefill, rid, p, sp)
        if h is None:
            decode.abort(rid)
            continue
        decode.install_prefilled(lease, h.seq.output_token_ids[0], None, h.seq.drafts, dict(h.state), None)
        back = gather_state(decode.cfg, decode.pools, lease, decode.ecfg.block_size, decode.runner.model)
        assert all(torch.equal(t, dict(h.state)[n]) for n, t in back)
        while decode.has_work():
            decode.step()
        assert lease.output_token_ids == oracle[tuple(p)][0], p
    assert decode.pools.blocks.num_used == 0 and decode.pools.slots.num_used == 0


# ---- worker processes ---------------------------------------------------------------------------------------


def start_router(prefill=None, decode=None, token=None) -> Child:
    """token: the internal token of the workers (those of a `tandem serve` require its own)."""
    return Child("router", ["router", "--model", MODEL, "--max-model-len", "256", "--num-speculative-tokens", str(K),
                            *COMMON, "--poll-seconds", "0.5", *(["--prefill-workers", prefill] if prefill else []),
                            "--decode-workers", decode], env={INTERNAL_TOKEN_ENV: token} if token else None)


def test_serve_tensor_parallel_equals_one_rank(oracle):
    """`tandem serve --tensor-parallel-size 2`: a prefill and a decode worker of two ranks each (tcp hand-off);
    then the same decode worker colocated, behind a router of its own without prefill workers (it prefills its
    leases itself). Every rank is gone once serve has stopped."""
    cluster = Cluster(*ENGINE, "--tensor-parallel-size", "2", "--prefill-workers", "1", "--decode-workers", "1",
                      "--transfer-backend", "tcp", "--no-metrics")
    router = None
    try:
        workers = [pid for name, pid in cluster.pids.items() if name != "router"]
        ranks = followers_of(workers)
        assert len(ranks) == len(workers) == 2  # one more rank per worker
        run_workload(cluster.client, oracle)
        assert_idle(cluster)
        router = start_router(decode=cluster.workers["decode-0"], token=cluster.internal_token)
        with TandemClient(router.wait_announced(time.monotonic() + 60)["grpc"]) as colocated:
            colocated.wait_ready(60)
            run_workload(colocated, oracle)
        assert_idle(cluster)
    finally:
        if router is not None:
            _stop_all([router], drain_timeout=5)
        assert cluster.stop() == 0
    assert router.proc.returncode == 0
    assert_gone(ranks)


def test_two_rank_prefill_worker_hands_off_to_one_rank_decode_worker(oracle):
    """The hand-off carries the full model's state, so workers of different TP sizes pair up (the fingerprint
    leaves the TP size out)."""
    deadline = time.monotonic() + 180
    children = []
    try:
        children.append(Child("prefill", ["prefill-worker", *ENGINE, *COMMON, "--tensor-parallel-size", "2",
                                          "--transfer-backend", "tcp"]))
        children.append(Child("decode", ["decode-worker", *ENGINE, *COMMON, "--transfer-port", "0"]))
        prefill, decode = (c.wait_announced(deadline)["grpc"] for c in children)
        router = start_router(prefill, decode)
        children.insert(0, router)
        ranks = followers_of([children[1].proc.pid])
        assert len(ranks) == 1 and not followers_of([children[2].proc.pid])
        with TandemClient(router.wait_announced(deadline)["grpc"]) as client:
            client.wait_ready(60)
            run_workload(client, oracle)
    finally:
        _stop_all(children, drain_timeout=5)
    assert [c.proc.returncode for c in children] == [0, 0, 0]
    assert_gone(ranks)


def test_a_lost_rank_ends_the_worker_so_it_can_be_restarted():
    """kill -9 of a decode worker's follower rank: the next request fails with an error (no hang) and the worker
    exits non-zero, for a supervisor (tandem serve --restart-workers, Kubernetes) to start it again."""
    deadline = time.monotonic() + 120
    children = []
    try:
        children.append(Child("decode", ["decode-worker", *ENGINE, *COMMON, "--transfer-port", "0",
                                          "--tensor-parallel-size", "2"]))
        decode = children[0].wait_announced(deadline)["grpc"]
        router = start_router(decode=decode)  # colocated: the decode worker prefills
        children.append(router)
        (rank,) = followers_of([children[0].proc.pid])
        with TandemClient(router.wait_announced(deadline)["grpc"]) as client:
            client.wait_ready(60)
            prompts, params = workload()
            assert client.generate_unary(prompts[0], params[0], timeout=60).token_ids  # serving before the loss
            rank.kill()
            assert_gone([rank])
            with pytest.raises(grpc.RpcError):
                client.generate_unary(prompts[1], params[1], timeout=60)
        children[0].proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert children[0].proc.returncode == 1
    finally:
        _stop_all(children, drain_timeout=5)
