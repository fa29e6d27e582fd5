"""API keys: the public gRPC service and HTTP /v1/* refuse calls without the key; health stays open for probes."""

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster
from tandem import SamplingParams
from tandem.client import TandemClient

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "key"
    path.write_text(KEY + "\n")
    c = Cluster("--model", "tiny-moe", "--api-key-file", str(path), api_key=KEY)
    yield c
    assert c.stop() == 0


def test_grpc_needs_the_key(cluster):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for key in (None, "wrong", KEY + "x"):
        with TandemClient(cluster.address, key) as client, pytest.raises(grpc.RpcError) as e:
            client.generate_unary([1, 2, 3], params, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(cluster.client.generate_unary([1, 2, 3], params, timeout=30).token_ids) == 3
    with grpc.insecure_channel(cluster.address) as ch:  # probes carry no key
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_http_needs_the_key(cluster):
    url = f"http://{cluster.http}"
    body = {"model": "tiny-moe", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert requests.get(url + "/health", timeout=10).status_code == 200
