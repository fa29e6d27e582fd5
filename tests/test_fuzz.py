"""Property-based bad and edge-case input against a running `tandem serve`: whatever a client sends over gRPC or
HTTP, the answer is a result or a client error (never INTERNAL / UNKNOWN / a 5xx), the servers stay up, and
nothing stays allocated."""

import json

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import Cluster, assert_idle
from tandem.rpc import router_pb2

# errors a client may get for its own input or for load; anything else is a server bug
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

u32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 70)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
edge_floats = st.one_of(floats, st.sampled_from([0.0, -0.0, 1.0, 1e-45, 2.0, -1.0, 1e30]))


@pytest.fixture(scope="module")
def cluster():
    # a short max_model_len keeps every valid request quick on the CPU
    c = Cluster("--model", "tiny-moe", "--max-model-len", "64", "--max-num-seqs", "8", "--block-size", "4")
    yield c
    assert c.stop() == 0


def mostly(plausible, extreme):
    """Values that pass validation most of the time (so requests reach the workers), edge cases otherwise."""
    return st.one_of(plausible, plausible, plausible, extreme)


@st.composite
def generate_requests(draw):
    req = router_pb2.GenerateRequest(request_id=draw(mostly(st.just(""), st.text(max_size=300))))
    kind = draw(st.sampled_from(["ids"] * 6 + ["text", "none"]))
    if kind == "ids":
        req.token_ids.ids.extend(draw(mostly(st.lists(st.integers(0, 511), min_size=1, max_size=40),
                                             st.lists(st.one_of(st.integers(0, 511), u32), max_size=60))))
    elif kind == "text":
        req.text = draw(st.text(max_size=50))
    s = req.sampling
    for name, plausible, extreme in (
            ("max_tokens", st.integers(1, 16), st.one_of(st.just(0), u32)),
            ("temperature", st.floats(0, 2), edge_floats), ("top_k", st.integers(0, 50), u32),
            ("top_p", st.floats(0.05, 1), edge_floats), ("min_p", st.floats(0, 0.5), edge_floats),
            ("seed", st.integers(-2**63, 2**63 - 1), st.just(0)),
            ("repetition_penalty", st.floats(0.5, 2), edge_floats), ("presence_penalty", st.floats(-2, 2), edge_floats),
            ("frequency_penalty", st.floats(-2, 2), edge_floats), ("logprobs", st.integers(0, 20), u32),
            ("ignore_eos", st.booleans(), st.booleans()), ("min_tokens", st.integers(0, 4), u32),
            ("prompt_logprobs", st.integers(0, 20), u32)):
        if draw(st.booleans()):
            setattr(s, name, draw(mostly(plausible, extreme)))
    if not s.HasField("max_tokens"):
        s.max_tokens = 16  # the default (up to max_model_len) would mostly be over the short max_model_len
    s.stop_token_ids.extend(draw(mostly(st.lists(st.integers(0, 511), max_size=3), st.lists(u32, max_size=5))))
    req.stop.extend(draw(st.lists(st.text(max_size=8), max_size=4)))
    req.skip_special_tokens = draw(st.booleans())
    return req


def test_grpc_input_never_breaks_the_router(cluster):
    stub = cluster.client.stub
    seen = {}

    @FUZZ
    @given(req=generate_requests(), streaming=st.booleans())
    def check(req, streaming):
        try:
            if streaming:
                list(stub.Generate(req, timeout=20))
            else:
                stub.GenerateUnary(req, timeout=20)
            seen["OK"] = seen.get("OK", 0) + 1
        except grpc.RpcError as e:
            seen[e.code().name] = seen.get(e.code().name, 0) + 1
            assert e.code() in CLIENT_CODES, (e.code(), e.details(), req)

    check()
    print(f"\ngRPC fuzz outcomes: {seen}")
    assert seen.get("OK", 0) >= 5  # the strategy does reach the workers, not only validation
    assert_idle(cluster)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | floats | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stop", "logprobs", "top_logprobs", "seed", "echo", "stream_options", "min_tokens", "ignore_eos",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of", "suffix", "logit_bias", "user"]
plausible = {"prompt": st.one_of(st.lists(st.integers(-5, 600), max_size=40), st.text(max_size=30),
                                 st.lists(st.lists(st.integers(0, 600), max_size=5), max_size=3)),
             "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 3]),
                                                         "content": json_values}), max_size=3),
             "max_tokens": st.one_of(st.integers(-2, 70), json_values), "n": st.one_of(st.integers(-1, 4), json_values),
             "stream": st.one_of(st.booleans(), json_values), "model": st.sampled_from(["tiny-moe", "other", None])}


plausible.update({"temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "seed": st.integers(0, 2**31),
                  "stop": st.lists(st.text(max_size=4), max_size=2), "logprobs": st.integers(0, 5),
                  "echo": st.booleans(),
                  "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})})


@st.composite
def http_bodies(draw):
    """A valid completion request, then a few fields set to plausible or arbitrary JSON."""
    body = {"prompt": draw(st.lists(st.integers(0, 511), min_size=1, max_size=30)),
            "max_tokens": draw(st.integers(1, 12))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(mostly(plausible.get(name, json_values), json_values)) if draw(st.booleans()) else \
            draw(plausible.get(name, json_values))
    return json.dumps(body, allow_nan=True).encode()


def test_http_input_never_gets_a_5xx(cluster):
    url = f"http://{cluster.http}"
    session = requests.Session()
    seen = {}

    @FUZZ
    @given(body=st.one_of(http_bodies(), http_bodies(), st.binary(max_size=64), json_values.map(
        lambda v: json.dumps(v).encode())), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(body, path):
        r = session.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text[:300], body[:300])

    check()
    print(f"\nHTTP fuzz outcomes: {seen}")
    assert seen.get(200, 0) >= 3
    assert session.get(url + "/health", timeout=10).status_code == 200
    assert_idle(cluster)
