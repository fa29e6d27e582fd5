"""Who may call what, and what every server answers to requests it cannot take: the public gRPC service and HTTP
/v1/* refuse calls without the API key; the workers' services refuse calls without the launch's internal token
(even with the API key); health and reflection (v1 and v1alpha) stay open for probes and grpcurl; bytes that are
not the method's protobuf message get INVALID_ARGUMENT; skip_special_tokens is true unless a gRPC request sets it."""

import os

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from cluster import Cluster, assert_idle
from tandem import SamplingParams
from tandem.cli import CHATML
from tandem.client import TandemClient
from tandem.rpc import worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import with_internal_token
from tandem.rpc.convert import sampling_to_proto
from tandem.tokenizer import load_tokenizer
from tandem.worker_setup import DEFAULT_MODEL

KEY = "s3cret-key"
BEARER = (("authorization", f"Bearer {KEY}"),)
MODEL_NAME = os.path.basename(DEFAULT_MODEL)  # tandem-tiny: it has a tokenizer, so requests get text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "key"
    path.write_text(KEY + "\n")
    c = Cluster("--max-model-len", "512", "--api-key-file", str(path), api_key=KEY)
    yield c
    assert c.stop() == 0


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_grpc_needs_the_key(cluster):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for key in (None, "wrong", KEY + "x"):
        with TandemClient(cluster.address, key) as client, pytest.raises(grpc.RpcError) as e:
            client.generate_unary([1, 2, 3], params, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(cluster.client.generate_unary([1, 2, 3], params, timeout=30).token_ids) == 3
    assert health(cluster.address) == health_pb2.HealthCheckResponse.SERVING  # probes carry no key


def test_http_needs_the_key(cluster):
    url = f"http://{cluster.http}"
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert requests.get(url + "/health", timeout=10).status_code == 200


def test_workers_need_the_internal_token(cluster):
    """Anyone who reaches a worker's port, with the API key or a wrong token, is refused before anything is
    leased; with the launch's token the same calls work; the router's serving path works throughout."""
    sp = sampling_to_proto(SamplingParams(max_tokens=3))

    def calls(ch, decode: bool):
        if not decode:
            return [lambda: worker_pb2_grpc.PrefillWorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10,
                                                                          metadata=BEARER)]
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        return [lambda: stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10, metadata=BEARER),
                lambda: stub.Reserve(worker_pb2.ReserveRequest(request_id="intruder", prompt_token_ids=[1, 2, 3],
                                                               sampling=sp), timeout=10, metadata=BEARER)]

    assert cluster.workers
    for name, address in cluster.workers.items():
        decode = name.startswith("decode")
        with grpc.insecure_channel(address) as plain:
            for token in (None, "wrong", cluster.internal_token + "x"):
                for call in calls(with_internal_token(plain, token), decode):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, token)
            load = calls(with_internal_token(plain, cluster.internal_token), decode)[0]()
            assert load.total_kv_blocks > 0
        assert health(address) == health_pb2.HealthCheckResponse.SERVING
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(cluster.client.generate_unary([1, 2, 3], params, timeout=30).token_ids) == 3
    assert_idle(cluster)  # no lease was granted to the intruder


def reflect(address: str, version: str, *requests_) -> list:
    """Server reflection's answers over `version` (v1 and v1alpha have the same messages on the wire)."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return list(call(iter(requests_), timeout=10))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(cluster, version):
    reflection = {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
    expected = {cluster.address: {"tandem.v1.Tandem"},
                cluster.workers["prefill-0"]: {"tandem.v1.PrefillWorker"},
                cluster.workers["decode-0"]: {"tandem.v1.DecodeWorker", "tandem.v1.PrefillWorker"}}
    for address, services in expected.items():
        listed, *described = reflect(address, version, reflection_pb2.ServerReflectionRequest(list_services=""),
                                    *(reflection_pb2.ServerReflectionRequest(file_containing_symbol=s)
                                      for s in sorted(services | {f"grpc.reflection.{version}.ServerReflection"})))
        names = {s.name for s in listed.list_services_response.service}
        assert names == services | reflection | {"grpc.health.v1.Health"}, address
        for answer in described:  # what `grpcurl describe` asks: each service's file
            assert answer.WhichOneof("message_response") == "file_descriptor_response", answer
            assert answer.file_descriptor_response.file_descriptor_proto


GARBAGE = b"\xff\xff\xff\xff"  # a field tag whose varint never ends: no protobuf message parses from it


def test_garbage_requests_are_invalid_argument(cluster):
    def raw(address, method, metadata, streaming=False, token=None):
        with grpc.insecure_channel(address) as ch:
            ch = with_internal_token(ch, token)
            with pytest.raises(grpc.RpcError) as e:
                if streaming:
                    list(ch.unary_stream(method)(GARBAGE, timeout=10, metadata=metadata))
                else:
                    ch.unary_unary(method)(GARBAGE, timeout=10, metadata=metadata)
            return e.value

    for method, streaming in (("/tandem.v1.Tandem/GetModelInfo", False), ("/tandem.v1.Tandem/Generate", True),
                              ("/tandem.v1.Tandem/GenerateUnary", False)):
        err = raw(cluster.address, method, BEARER, streaming)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and method in err.details(), err
        # a caller without the key learns nothing about its bytes
        assert raw(cluster.address, method, None, streaming).code() == grpc.StatusCode.UNAUTHENTICATED
    for address in cluster.workers.values():
        err = raw(address, "/tandem.v1.PrefillWorker/GetLoad", None, token=cluster.internal_token)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    with grpc.insecure_channel(cluster.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")(iter([GARBAGE]),
                                                                                               timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(cluster.client.generate_unary([1, 2, 3], SamplingParams(max_tokens=2), timeout=30).token_ids) == 2


def test_skip_special_tokens_defaults_to_true(cluster):
    """Unset on gRPC means true, as over HTTP: the text is the tokenizer's decode without special tokens."""
    tok = load_tokenizer(DEFAULT_MODEL)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # past <|im_end|>: more turns follow
    out = {}
    for skip in (None, True, False):
        req = cluster.client.request(CHATML.format("Say hi") + "Hi!", params)
        if skip is not None:
            req.skip_special_tokens = skip
        out[skip] = cluster.client.stub.GenerateUnary(req, timeout=60, metadata=BEARER)
    ids = list(out[None].token_ids)
    assert set(ids) & set(tok.all_special_ids), "the reply has no special token to skip: pick another prompt"
    assert list(out[False].token_ids) == list(out[True].token_ids) == ids
    assert out[None].text == out[True].text == tok.decode(ids, skip_special_tokens=True)
    assert out[False].text == tok.decode(ids, skip_special_tokens=False) != out[None].text
