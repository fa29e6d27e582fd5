"""Structured outputs served by `tandem serve` (tandem-tiny, which never writes JSON unprompted), read by the official
`openai` client, in all four mode / k combinations (colocated and disaggregated, k = 0 and 2; one cluster each):
json_schema answers validate (jsonschema), regex answers match, choice answers are a choice, the arguments of
required and named tool calls validate against the tool's parameters, streamed answers equal the non-streamed ones
(greedy, and seeded at temperature 1), an answer cut by max_tokens mid-JSON ends with "length". Disaggregated, the
prefill worker samples the first token under the grammar and the decode worker's matcher continues after it. The
colocated k = 2 cluster has two decode workers and --decode-failover: constrained streams whose decode worker is
killed mid-answer continue on the other one, their matcher advanced over the tokens already produced, and still
validate (greedy: the uninterrupted answer exactly); in every combination, gRPC's `resumed_tokens` (what failover
sends) continues an answer the prompt ends with. Bad constraints are a 400 / INVALID_ARGUMENT with the parser's
message before the request takes a seat. Each test sends its requests at once (one batch: the suite's time)."""

import json
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from cluster import Cluster, assert_idle
from tandem.engine.sampling_params import SamplingParams
from tandem.rpc import common_pb2
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
FAILOVER = ("colocated", 2)  # the combination whose cluster has two decode workers and decode failover
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40, "maxItems": 40}
PROMPTS = ["The sea is", "Count: one two", "Hello there", "Tell me a story", "Answer yes or no", "Numbers:"]


@pytest.fixture(scope="module", params=[("colocated", 0), ("colocated", 2), ("disaggregated", 0),
                                        ("disaggregated", 2)], ids=lambda p: f"{p[0]}-k{p[1]}")
def served(request):
    mode, k = request.param
    failover = ["--decode-workers", "2", "--decode-failover", "--restart-workers", "--poll-seconds", "0.5"]
    cluster = Cluster(*ENGINE, "--num-speculative-tokens", str(k), "--prefill-workers",
                      "0" if mode == "colocated" else "1", *(failover if request.param == FAILOVER else []))
    cluster.combination = request.param
    try:
        yield cluster, openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="none", max_retries=0)
    finally:
        assert cluster.stop() == 0


def together(*calls):
    """Runs the calls at once (one batch in the engine); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


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


@pytest.mark.parametrize("served", [FAILOVER], indirect=True, ids=lambda p: f"{p[0]}-k{p[1]}")
def test_constrained_streams_survive_decode_failover(served, capsys):
    """A decode worker killed while it streams constrained answers: each of its streams is re-placed on the other
    worker with the answer so far in the prompt, its matcher advanced over it, so every answer still validates
    and a greedy one equals the same request's uninterrupted answer. First of its cluster's tests: the killed
    worker restarts while the others run (the last one checks that everything is healthy and free again)."""
    cluster, _ = served
    so = StructuredOutputs(json=LONG, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so)] * 4 + [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=so) for s in (1, 2)]

    def run(prompt, p, started=None):
        ids, text, reason = [], "", None
        for i, m in enumerate(cluster.client.generate(prompt, p, timeout=120)):
            ids.extend(m.token_ids)
            text += m.text
            reason = m.finish_reason
            if started is not None and i == 2:
                started.wait(60)
        return ids, text, reason

    want = together(*[lambda pr=pr, p=p: run(pr, p) for pr, p in zip(PROMPTS, params)])  # uninterrupted
    started = threading.Barrier(len(PROMPTS) + 1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(run, pr, p, started) for pr, p in zip(PROMPTS, params)]
        started.wait(60)  # every stream is decoding: kill the worker the router last saw running more of them
        loads = {w.address: w.load.running_requests for w in cluster.client.server_info().workers}
        victim = max(("decode-0", "decode-1"), key=lambda name: loads.get(cluster.workers[name], 0))
        os.kill(cluster.pids[victim], signal.SIGKILL)
        got = [f.result() for f in futs]
    for (ids, text, reason), (want_ids, _, _), p in zip(got, want, params):
        assert reason == common_pb2.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), LONG)
        assert ids == want_ids or not p.greedy
    failovers = capsys.readouterr().err.count("failing over")
    assert failovers, "no stream failed over"
    print(f"\nconstrained decode failover: {failovers} of {len(PROMPTS)} streams moved, all valid")


def test_json_schema_answers_validate(served):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    kws = [dict(response_format=fmt, max_tokens=48, extra_body=COMPACT, **sampling) for sampling in SAMPLING]
    cut = dict(response_format=fmt, max_tokens=5, extra_body=COMPACT, temperature=0.0)
    *answers, short = together(*[lambda kw=kw, st=st: chat(client, st, **kw) for kw in kws for st in (False, True)],
                               lambda: chat(client, True, **cut))
    for full, streamed in zip(answers[::2], answers[1::2]):
        assert streamed == full
        content, calls, reason = full
        assert reason == "stop" and calls == []
        jsonschema.validate(json.loads(content), SCHEMA)
    # max_tokens mid-JSON: "length", and what came is the start of the greedy answer
    assert short[2] == "length" and short[0].startswith('{"') and answers[0][0].startswith(short[0]), short


def test_regex_choice_and_json_object_completions(served):
    _, client = served
    cases = [(so, max_tokens, check, sampling)
             for so, max_tokens, check in (({"regex": REGEX}, 16, lambda t: re.fullmatch(REGEX, t)),
                                           ({"choice": CHOICES}, 8, lambda t: t in CHOICES),
                                           ({"json_object": True, "disable_any_whitespace": True}, 24, None))
             for sampling in SAMPLING]
    kws = [dict(max_tokens=max_tokens, extra_body={"structured_outputs": so}, **sampling)
           for so, max_tokens, _, sampling in cases]
    outs = together(*[lambda kw=kw, st=st: complete(client, st, **kw) for kw in kws for st in (False, True)])
    for (so, _, check, _), full, streamed in zip(cases, outs[::2], outs[1::2]):
        assert streamed == full
        text, reason = full
        if check is not None:
            assert reason == "stop" and check(text), (so, text)
        else:  # any object: it may run past max_tokens, but what came is an object's beginning
            assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text


def test_named_and_required_tool_calls_validate(served):
    _, client = served
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    cases = [(choice, sampling) for choice in ({"type": "function", "function": {"name": "add"}}, "required")
             for sampling in SAMPLING]
    kws = [dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=100, **sampling)
           for choice, sampling in cases]
    outs = together(*[lambda kw=kw, st=st: chat(client, st, **kw) for kw in kws for st in (False, True)])
    for (choice, _), full, streamed in zip(cases, outs[::2], outs[1::2]):
        assert streamed == full
        content, calls, reason = full
        assert reason == "tool_calls" and len(calls) == 1 and content == "", full
        name, args = calls[0]
        assert name == "add" if isinstance(choice, dict) else name in params
        jsonschema.validate(args, params[name])


def test_resumed_tokens_continue_an_answer(served):
    """gRPC's `resumed_tokens` (what decode failover sends): a prompt that ends with the first m tokens of a
    constrained answer continues it, the workers' matchers (disaggregated: the prefill worker's and the decode
    worker's) started after them, to the greedy answer's exact rest; more of them than the prompt holds is
    INVALID_ARGUMENT."""
    cluster, _ = served
    prompt, so = [5, 6, 7, 8], dict(json=json.dumps(SCHEMA), disable_any_whitespace=True)

    def tokens(ids, m, max_tokens):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                           structured_outputs=StructuredOutputs(**so, resumed_tokens=m))
        return [t for r in cluster.client.generate(ids, p, timeout=60) for t in r.token_ids]

    full = tokens(prompt, 0, 48)
    cuts = (1, len(full) // 2)
    rests = together(*[lambda m=m: tokens(prompt + full[:m], m, 48 - m) for m in cuts])
    for m, rest in zip(cuts, rests):
        assert full[:m] + rest == full, m
    with pytest.raises(grpc.RpcError) as e:
        tokens(prompt, len(prompt) + 1, 4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the prompt" in e.value.details()


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
