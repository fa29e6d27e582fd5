"""Disaggregated serving end to end: `tandem serve` (router + prefill + decode worker processes over loopback)
against the colocated `LLM` as the oracle, plus streaming, abort, cancel, bad input, deadline and checksum."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from cluster import Cluster, assert_idle, cancel_at_three_stages, long_request
from tandem import LLM, SamplingParams
from tandem.rpc import common_pb2, router_pb2
from tandem.model.source import model_config
from tandem.worker_setup import DEFAULT_MODEL

K = 2
MODEL = DEFAULT_MODEL  # the trained tandem-tiny: its MTP drafts are really accepted
VOCAB = model_config(MODEL).vocab_size
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-speculative-tokens", str(K), "--block-size", "4",
          "--max-model-len", "1024", "--max-num-seqs", "6", "--max-num-batched-tokens", "64"]


def workload(n=18):
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 512, (m,), generator=g).tolist() for m in lengths]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0) for m in torch.randint(1, 24, (n,), generator=g)]
    return prompts, params


def colocated(emulated_acceptance=None):
    """Colocated outputs for the workload: {tuple(prompt): (token ids, finish reason)}."""
    prompts, params = workload()
    llm = LLM(model=MODEL, dtype="float32", max_model_len=1024, emulated_acceptance=emulated_acceptance,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return {tuple(p): (o.outputs[0].token_ids, o.outputs[0].finish_reason) for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def oracle():
    return colocated()


def stream(client, prompt, params):
    msgs = list(client.generate(prompt, params, timeout=120))
    assert msgs and len(msgs[0].token_ids) == 1  # the first token comes from the prefill worker alone
    assert all(m.finish_reason == 0 for m in msgs[:-1]) and msgs[-1].finish_reason != 0
    ids = [t for m in msgs for t in m.token_ids]
    assert [m.completion_tokens for m in msgs] == list(torch.tensor([len(m.token_ids) for m in msgs]).cumsum(0))
    assert msgs[-1].prompt_tokens == len(prompt)
    reason = common_pb2.FinishReason.Name(msgs[-1].finish_reason).removeprefix("FINISH_REASON_").lower()
    return ids, reason, len(msgs)


# Each hand-off backend with two workers of each role (more than max_num_seqs per worker still, and the router
# choosing among them), and one worker of each with every draft accepted (emulated: messages carry k + 1 tokens).
# One worker of each with real acceptance, over either backend, ran the same code as these and was dropped.
@pytest.mark.parametrize("workers,backend,accept_all", [
    (2, "tcp", False), (2, "torch_distributed", False), (1, "tcp", True),
])
def test_concurrent_requests_equal_colocated(request, oracle, workers, backend, accept_all):
    extra = ["--emulated-acceptance", "1.0,1.0"] if accept_all else []
    # two workers each over tcp (the CPU's default hand-off) is the module's cluster: no need to start it twice
    shared = (workers, backend, accept_all) == (2, "tcp", False)
    cluster = request.getfixturevalue("cluster") if shared else Cluster(
        *ENGINE, "--prefill-workers", str(workers), "--decode-workers", str(workers), "--transfer-backend", backend,
        *extra)
    try:
        prompts, params = workload()
        with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: more than max_num_seqs per worker
            results = list(pool.map(lambda pp: stream(cluster.client, *pp), zip(prompts, params)))
        want = colocated((1.0, 1.0)) if accept_all else oracle
        for p, (ids, reason, _) in zip(prompts, results):
            assert (ids, reason) == want[tuple(p)], p
        if accept_all:
            assert all(n <= 2 + (len(ids) - 1) // (K + 1) for ids, _, n in results)
        else:  # real acceptance: some messages carry several tokens
            assert any(n < len(ids) for ids, _, n in results)
        info = cluster.client.server_info()
        assert info.transfer_backend in ("", backend) and len(info.workers) == 2 * workers
        assert_idle(cluster)
    finally:
        if not shared:
            assert cluster.stop() == 0


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(*ENGINE, "--prefill-workers", "2", "--decode-workers", "2")
    yield c
    assert c.stop() == 0


def test_unary_equals_stream(cluster, oracle):
    prompts, params = workload()
    for p, sp in list(zip(prompts, params))[:4]:
        out = cluster.client.generate_unary(p, sp, timeout=60)
        ids, reason = oracle[tuple(p)]
        assert list(out.token_ids) == ids and out.completion_tokens == len(ids) and out.prompt_tokens == len(p)
        assert common_pb2.FinishReason.Name(out.finish_reason).removeprefix("FINISH_REASON_").lower() == reason
    assert_idle(cluster)


def test_text_in_text_out(cluster):
    out = cluster.client.generate_unary("Hello! What can you do?", SamplingParams(max_tokens=12, temperature=0.0,
                                                                                  ignore_eos=True),
                                        timeout=60)
    assert len(out.token_ids) == 12 and out.text.strip()
    assert_idle(cluster)


def test_abort_mid_stream_frees_everything(cluster):
    call = cluster.client.generate(*long_request(), request_id="to-abort", timeout=120)
    it = iter(call)
    first = [next(it), next(it)]
    assert cluster.client.stub.Abort(router_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    rest = list(it)
    assert rest and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in first + rest) < 900
    assert not cluster.client.stub.Abort(router_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    assert_idle(cluster)


def test_client_cancel_frees_everything(cluster):
    cancel_at_three_stages(cluster)


def test_deadline_exceeded_frees_everything(cluster):
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.client.generate(*long_request(), timeout=0.8))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(cluster)


@pytest.mark.parametrize("prompt,params,needle", [
    ([], SamplingParams(), "empty"),
    ([1] * 1020, SamplingParams(max_tokens=16), "max_model_len"),
    ([1, 2, VOCAB], SamplingParams(), "out of range"),
    ([1, 2, 3], SamplingParams(max_tokens=4, logprobs=50), "logprobs"),
    ([1, 2, 3], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
])
def test_bad_input_is_invalid_argument(cluster, prompt, params, needle):
    with pytest.raises(grpc.RpcError) as e:
        cluster.client.generate_unary(prompt, params, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert_idle(cluster)


def test_invalid_sampling_values_are_invalid_argument(cluster):
    for field, value in (("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0)):
        req = cluster.client.request([1, 2, 3])
        setattr(req.sampling, field, value)
        with pytest.raises(grpc.RpcError) as e:
            cluster.client.stub.GenerateUnary(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), (field, value)
    req = router_pb2.GenerateRequest()  # no prompt at all
    with pytest.raises(grpc.RpcError) as e:
        cluster.client.stub.GenerateUnary(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_idle(cluster)


def test_corrupted_handoff_is_an_error_not_text():
    c = Cluster(*ENGINE, "--inject-fault", "corrupt-handoff")
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(c.client.generate([3, 4, 5, 6, 7], SamplingParams(max_tokens=8), timeout=60))
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.details()
        assert_idle(c)
    finally:
        assert c.stop() == 0
