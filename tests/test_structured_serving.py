"""Structured outputs served by `tandem serve` (tandem-tiny, which never writes JSON unprompted), read by the official
`openai` client: json_schema answers validate (jsonschema), regex answers match, choice answers are a choice, the
arguments of required and named tool calls validate against the tool's parameters, streamed answers equal the
non-streamed ones (seeded at temperature 1), colocated with k = 0 and disaggregated with k = 2 (the prefill worker
samples the first token under the grammar, the decode worker's matcher continues after it). Bad constraints are a
400 / INVALID_ARGUMENT with the parser's message before the request takes a seat."""

import json
import re

import grpc
import jsonschema
import openai
import pytest

from cluster import Cluster, assert_idle
from tandem.engine.sampling_params import SamplingParams
from tandem.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}, "s": {"type": "string", "maxLength": 3}},
          "required": ["ok", "n", "tag", "s"], "additionalProperties": False}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
REGEX = r"[a-c]{2,4}-\d\d"
CHOICES = ["yes", "no", "maybe so"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 9}, "b": {"type": "boolean"}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
USER = [{"role": "user", "content": "Weather in Paris?"}]
ENGINE = ["--dtype", "float32", "--block-size", "4", "--max-model-len", "512", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "64", "--served-model-name", "m"]
SAMPLING = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}]


@pytest.fixture(scope="module", params=[("colocated", 0), ("disaggregated", 2)], ids=lambda p: f"{p[0]}-k{p[1]}")
def served(request):
    mode, k = request.param
    cluster = Cluster(*ENGINE, "--num-speculative-tokens", str(k), "--prefill-workers",
                      "0" if mode == "colocated" else "1")
    try:
        yield cluster, openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="none", max_retries=0)
    finally:
        assert cluster.stop() == 0


def chat(client, stream: bool, **kw):
    """(content, tool calls as (name, arguments), finish_reason), streamed or not."""
    kw = {"model": "m", "messages": USER, **kw}
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
        return c.message.content or "", calls, c.finish_reason
    content, calls, reason = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            slot = calls.setdefault(t.index, ["", ""])
            slot[0] += t.function.name or ""
            slot[1] += t.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], reason


def complete(client, stream: bool, **kw):
    kw = {"model": "m", "prompt": "The answer is", **kw}
    if not stream:
        c = client.completions.create(**kw).choices[0]
        return c.text, c.finish_reason
    text, reason = "", None
    for ch in client.completions.create(stream=True, **kw):
        text += ch.choices[0].text
        reason = ch.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("sampling", SAMPLING, ids=["t0", "t1"])
def test_json_schema_answers_validate(served, sampling):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    kw = dict(response_format=fmt, max_tokens=48, extra_body=COMPACT, **sampling)
    full = chat(client, False, **kw)
    assert chat(client, True, **kw) == full
    content, calls, reason = full
    assert reason == "stop" and calls == []
    jsonschema.validate(json.loads(content), SCHEMA)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["t0", "t1"])
def test_regex_choice_and_json_object_completions(served, sampling):
    _, client = served
    for so, max_tokens, check in (({"regex": REGEX}, 16, lambda t: re.fullmatch(REGEX, t)),
                                  ({"choice": CHOICES}, 8, lambda t: t in CHOICES),
                                  ({"json_object": True, "disable_any_whitespace": True}, 24, None)):
        kw = dict(max_tokens=max_tokens, extra_body={"structured_outputs": so}, **sampling)
        full = complete(client, False, **kw)
        assert complete(client, True, **kw) == full
        text, reason = full
        if check is not None:
            assert reason == "stop" and check(text), (so, text)
        else:  # any object: it may run past max_tokens, but what came is an object's beginning
            assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text


@pytest.mark.parametrize("sampling", SAMPLING, ids=["t0", "t1"])
def test_named_and_required_tool_calls_validate(served, sampling):
    _, client = served
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        kw = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=100, **sampling)
        full = chat(client, False, **kw)
        assert chat(client, True, **kw) == full
        content, calls, reason = full
        assert reason == "tool_calls" and len(calls) == 1 and content == "", full
        name, args = calls[0]
        assert name == "add" if isinstance(choice, dict) else name in params
        jsonschema.validate(args, params[name])


def test_bad_constraints_are_refused(served):
    cluster, client = served
    bad = [dict(extra_body={"structured_outputs": {"regex": "a(b"}}),
           dict(extra_body={"structured_outputs": {"json": {"type": "nope"}}}),
           dict(extra_body={"structured_outputs": {"grammar": "start: nowhere"}}),
           dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}),
           dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
           dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "absent"}})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=USER, max_tokens=4, **kw)
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model="m", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "a(b"}})
    with pytest.raises(grpc.RpcError) as e:  # gRPC: the field in SamplingParams
        list(cluster.client.generate([5, 6, 7], SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputs(json='{"type": "nope"}')), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in e.value.details()
    ok = list(cluster.client.generate([5, 6, 7], SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(choice=CHOICES)), timeout=60))
    assert "".join(m.text for m in ok) in CHOICES  # the same field, valid, is served
    assert_idle(cluster)
