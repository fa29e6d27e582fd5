"""Property-based bad and edge-case input against a running `tandem serve`: whatever a client sends over gRPC or
HTTP, the answer is a result or a client error (never INTERNAL / UNKNOWN / a 5xx; over HTTP always OpenAI's error
JSON), the servers stay up, and nothing stays allocated.

The model is a checkpoint directory with a tokenizer and a chat template (tests/test_http.py), so text prompts,
chat and the tokenizer routes run for real. TANDEM_FUZZ_EXAMPLES=N sets the examples per test (a longer run by hand).
"""

import json
import os

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import Cluster, assert_idle
from tandem.rpc import router_pb2
from test_http import make_text_model_dir

# errors a client may get for its own input or for load; anything else is a server bug
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", 200)), deadline=None,
                suppress_health_check=list(HealthCheck), derandomize=True)

u32 = st.integers(0, 2**32 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
edge_floats = st.one_of(floats, st.sampled_from([0.0, -0.0, 1.0, 1e-45, 2.0, -1.0, 1e30]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a short max_model_len keeps every valid request quick on the CPU
    model = make_text_model_dir(tmp_path_factory.mktemp("fuzz-model"))
    c = Cluster("--model", model, "--served-model-name", "fuzz-model", "--max-model-len", "64", "--max-num-seqs", "8",
                "--block-size", "4")
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


# strings with lone surrogates now and then: JSON's "\ud800" escapes, which protobuf and tokenizers cannot encode
chars = st.one_of(st.characters(), st.characters(), st.characters(), st.integers(0xD800, 0xDFFF).map(chr))
texts = st.text(chars, max_size=20)
ints = st.one_of(st.integers(-5, 600), st.integers(-2**70, 2**70), st.sampled_from([2**31, 2**32, 2**63, -2**63 - 1]))
deep = st.integers(60, 3000).map(lambda d: "[" * d + "]" * d)  # raw JSON nested past every bound
json_values = st.recursive(st.none() | st.booleans() | ints | floats | texts,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                           max_leaves=12)
token_lists = st.lists(st.one_of(st.integers(0, 511), st.integers(0, 511), ints), max_size=30)
text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]),
                                             "text": st.one_of(texts, json_values)}), max_size=2)
schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"]}}}
function = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", ""])}, optional={
    "description": st.one_of(texts, json_values), "parameters": st.one_of(st.just(schema), json_values)})
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "x"]), "function": function})
call = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                              "arguments": st.one_of(st.just('{"a": 1}'), texts, json_values)})
tool_calls = st.lists(st.fixed_dictionaries({"id": texts, "type": st.just("function"), "function": call}), max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]),
     "content": st.one_of(texts, texts, text_parts, json_values)},
    optional={"name": st.one_of(texts, json_values), "tool_calls": st.one_of(tool_calls, json_values),
              "tool_call_id": texts}), max_size=3)
# every field the endpoints read, with plausible values (reaching the workers) beside arbitrary JSON
PLAUSIBLE = {
    "model": st.sampled_from(["fuzz-model", "other", None]), "prompt": st.one_of(
        token_lists, texts, st.lists(st.one_of(texts, token_lists), max_size=3)),
    "messages": messages, "suffix": st.sampled_from(["", "x", None]), "logit_bias": st.sampled_from([{}, {"5": 1}]),
    "use_beam_search": st.booleans(), "prompt_logprobs": st.integers(0, 3), "echo": st.booleans(),
    "n": st.integers(-1, 3), "best_of": st.integers(0, 3), "logprobs": st.one_of(st.integers(-1, 21), st.booleans()),
    "top_logprobs": st.integers(-1, 21), "max_tokens": st.integers(-1, 70),
    "max_completion_tokens": st.integers(-1, 70),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": ints, "min_p": st.floats(-0.5, 1.5),
    "seed": ints, "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.one_of(st.floats(0, 3), ints), "stop_token_ids": token_lists,
    "ignore_eos": st.booleans(), "min_tokens": ints, "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "skip_special_tokens": st.booleans(), "user": texts, "tools": st.lists(tool, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})})),
    "parallel_tool_calls": st.booleans(), "response_format": st.sampled_from([{"type": "text"},
                                                                                          {"type": "json_object"}]),
    "chat_template_kwargs": st.one_of(st.fixed_dictionaries({"enable_thinking": st.booleans()}),
                                      st.dictionaries(texts, json_values, max_size=2)),
    "add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
    "tokens": token_lists,
}
FIELDS = sorted(PLAUSIBLE)
BASE = {  # a valid request per endpoint, which the drawn fields then change
    "/v1/completions": lambda d: {"prompt": d(st.lists(st.integers(0, 511), min_size=1, max_size=20)),
                                  "max_tokens": d(st.integers(1, 8))},
    "/v1/chat/completions": lambda d: {"messages": [{"role": "user", "content": d(st.text(max_size=20))}],
                                       "max_tokens": d(st.integers(1, 8))},
    "/tokenize": lambda d: {"prompt": d(st.text(max_size=20))},
    "/detokenize": lambda d: {"tokens": d(st.lists(st.integers(0, 255), max_size=20))},  # bytes: in any vocab
}


@st.composite
def http_requests(draw):
    """(path, body bytes): a valid request, then a few fields set to plausible or arbitrary JSON; or garbage."""
    path = draw(st.sampled_from(sorted(BASE)))
    kind = draw(st.sampled_from(["fields"] * 8 + ["deep", "bytes", "json"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(json_values)).encode()
    body = BASE[path](draw)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(mostly(PLAUSIBLE[name], json_values))
    raw = json.dumps(body, allow_nan=True)
    if kind == "deep":
        raw = raw[:-1] + f', "{draw(st.sampled_from(FIELDS))}": {draw(deep)}}}'
    return path, raw.encode()


def assert_openai_error(r) -> None:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err


def test_http_input_never_gets_a_5xx(cluster):
    url = f"http://{cluster.http}"
    session = requests.Session()
    seen = {}

    @settings(FUZZ, max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", 300)))
    @given(req=http_requests())
    def check(req):
        path, body = req
        r = session.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        seen[(path, r.status_code)] = seen.get((path, r.status_code), 0) + 1
        assert r.status_code < 500, (r.status_code, r.text[:300], body[:300])
        if r.status_code >= 400:
            assert_openai_error(r)
        elif r.headers["Content-Type"].startswith("text/event-stream"):  # errors mid-stream are client errors too
            events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            assert all(e["error"]["type"] != "server_error" for e in events if "error" in e), r.text[:300]

    check()
    print(f"\nHTTP fuzz outcomes: {dict(sorted(seen.items()))}")
    for path in BASE:
        assert seen.get((path, 200), 0) >= 3, (path, seen)  # each endpoint was reached, not only its validation
    assert session.get(url + "/health", timeout=10).status_code == 200
    assert_idle(cluster)
