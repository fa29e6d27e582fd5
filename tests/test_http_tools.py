"""Reasoning and tool calls on the OpenAI chat API (router/http.py with router/chat_choice.py): the request fields
(`tools`, `tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`), the rendered prompt, and the answer's
`reasoning_content` / `tool_calls`, streamed and not, read by the official `openai` client.

The model directory is tandem-tiny's with a Qwen3.5-style chat template written here from the format's public
description (tools in the system turn, `<tool_call>` for the assistant's calls, `<tool_response>` for tool results,
`<think>` opened by the generation prompt unless enable_thinking is false). tandem-tiny never writes think tags or
tool calls, so the answers' parsing runs against a fake router that streams scripted Qwen3.5 outputs (cut at awkward
points), and `tandem serve` checks the plumbing end to end."""

import argparse
import json
import shutil
from concurrent import futures

import grpc
import openai
import pytest
import requests

from cluster import Cluster
from router.chat_parsers import Parsers, parser_argv
from router.http import start_http_server
from router.main import add_args as router_args
from tandem.launch import add_args as launch_args
from tandem.rpc import common_pb2, router_pb2, router_pb2_grpc
from tandem.tokenizer import load_tokenizer
from tandem.worker_setup import DEFAULT_MODEL

TEMPLATE = (  # whitespace written out in strings: HF renders templates with trim_blocks and lstrip_blocks
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write <tool_call>\\n<function=NAME>\\n<parameter=PARAM>\\nVALUE\\n'"
    "    '</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for k, v in call.function.arguments | items %}"
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def make_tool_model_dir(path) -> str:
    shutil.copytree(DEFAULT_MODEL, path, dirs_exist_ok=True)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("tool-model"))


# ---- against a fake router: the answer's parsing -----------------------------------------------------------------
class FakeRouter(router_pb2_grpc.TandemServicer):
    """Streams `self.pieces` as one choice's output, whatever the request; the last piece ends with `self.reason`."""
    pieces: list[str] = []
    reason = common_pb2.FINISH_REASON_STOP

    def Generate(self, request, context):
        self.last = request
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7], text=p,
                                              finish_reason=self.reason if last else 0, prompt_tokens=3,
                                              completion_tokens=i + 1)

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(num_speculative_tokens=0)


@pytest.fixture(scope="module")
def fake(model_dir):
    router = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    router_pb2_grpc.add_TandemServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tok = load_tokenizer(model_dir)
    https = [start_http_server(f"127.0.0.1:{port}", "127.0.0.1", 0, "m", tok, 4096, parsers=p) for p in (
        Parsers("qwen3", "qwen3_coder", True), Parsers("qwen3", "qwen3_coder", False), Parsers())]
    try:
        yield router, [f"http://127.0.0.1:{h.port}" for h in https], tok
    finally:
        for h in https:
            h.stop()
        server.stop(None)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def ask(url: str, stream: bool, **kw):
    """(message-like dict, finish_reason) of one chat request, streamed or not, as the openai client reads it."""
    c = client_of(url)
    kw = {"model": "m", "messages": USER, "tools": TOOLS, "max_tokens": 50, **kw}
    if not stream:
        out = c.chat.completions.create(**kw).choices[0]
        m = out.message
        calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        return {"content": m.content or "", "reasoning": getattr(m, "reasoning_content", None) or "",
                "calls": calls}, out.finish_reason
    msg, calls, reason = {"content": "", "reasoning": ""}, {}, None
    for ch in c.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        msg["content"] += d.content or ""
        msg["reasoning"] += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or []:
            slot = calls.setdefault(t.index, ["", "", ""])
            slot[0] += t.id or ""
            slot[1] += t.function.name or ""
            slot[2] += t.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    msg["calls"] = [(i, n, json.loads(a)) for i, n, a in (calls[k] for k in sorted(calls))]
    return msg, reason


THOUGHT_AND_CALLS = ["The user wants the weather.\n</th", "ink>\n\nLet me check.\n<tool", "_call>\n<function=get_",
                     "weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n", "2\n</parameter>\n</fun",
                     "ction>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nParis news\n",
                     "</parameter>\n</function>\n</tool_call>"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_tool_calls(fake, stream):
    router, (url, _, _), _ = fake
    router.pieces, router.reason = THOUGHT_AND_CALLS, common_pb2.FINISH_REASON_STOP
    msg, reason = ask(url, stream)
    assert reason == "tool_calls"
    assert msg["reasoning"] == "The user wants the weather.\n" and msg["content"] == "Let me check.\n\n"
    assert [c[1:] for c in msg["calls"]] == [("get_weather", {"city": "Paris", "days": 2}),
                                             ("search", {"query": "Paris news"})]
    assert all(c[0].startswith("call_") for c in msg["calls"]) and msg["calls"][0][0] != msg["calls"][1][0]


def test_several_choices_each_parse_their_own_answer(fake):
    router, (url, _, _), _ = fake
    router.pieces, router.reason = THOUGHT_AND_CALLS, common_pb2.FINISH_REASON_STOP
    c = client_of(url)
    kw = {"model": "m", "messages": USER, "tools": TOOLS, "max_tokens": 50, "n": 2}
    full = c.chat.completions.create(**kw)
    calls = {}
    for ch in c.chat.completions.create(stream=True, **kw):
        for t in ch.choices[0].delta.tool_calls or []:
            calls.setdefault(ch.choices[0].index, []).append((t.index, t.function.name))
    assert calls == {i: [(0, "get_weather"), (1, "search")] for i in (0, 1)}
    ids = [t.id for ch in full.choices for t in ch.message.tool_calls]
    assert [ch.finish_reason for ch in full.choices] == ["tool_calls"] * 2 and len(set(ids)) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_disabled_leaves_everything_content(fake, stream):
    router, (url, _, _), _ = fake
    router.pieces, router.reason = ["not thinking</thi", "nk> at all"], common_pb2.FINISH_REASON_STOP
    msg, reason = ask(url, stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (msg["content"], msg["reasoning"], reason) == ("not thinking</think> at all", "", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_and_unterminated_calls_stay_content(fake, stream):
    router, (url, _, _), _ = fake
    call = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>"
    router.pieces, router.reason = ["</think>", call], common_pb2.FINISH_REASON_STOP
    msg, reason = ask(url, stream, tool_choice="none")
    assert (msg["content"], msg["calls"], reason) == (call, [], "stop")
    router.pieces, router.reason = ["</think>ok ", call[:40]], common_pb2.FINISH_REASON_LENGTH
    msg, reason = ask(url, stream)
    assert (msg["content"], msg["calls"], reason) == ("ok " + call[:40], [], "length")


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_parse_as_auto(fake, stream):
    router, (url, no_auto, _), _ = fake
    router.pieces, router.reason = THOUGHT_AND_CALLS, common_pb2.FINISH_REASON_STOP
    for choice in ("required", {"type": "function", "function": {"name": "search"}}):
        for server in (url, no_auto):  # neither needs --enable-auto-tool-choice
            msg, reason = ask(server, stream, tool_choice=choice, parallel_tool_calls=False)
            assert [c[1] for c in msg["calls"]] == ["get_weather"] and reason == "tool_calls"


def post(url, body, path="/v1/chat/completions"):
    return requests.post(url + path, json={"messages": USER, "max_tokens": 5, **body}, timeout=30)


@pytest.mark.parametrize("server,body,param", [
    (0, {"tools": {"type": "function"}}, "tools"),
    (0, {"tools": [{"type": "function"}]}, "tools"),
    (0, {"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
    (0, {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    (0, {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    (0, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]}, "tools"),
    (0, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (0, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    (0, {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    (0, {"tool_choice": "required"}, "tool_choice"),
    (0, {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (0, {"response_format": {"type": "xml"}}, "response_format"),
    (0, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (0, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    (0, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
    (0, {"messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]}, "messages"),
    (1, {"tools": TOOLS}, "tool_choice"),  # auto (the default with tools) without --enable-auto-tool-choice
    (1, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    (2, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),  # no tool-call parser at all
])
def test_bad_tool_requests_are_a_400(fake, server, body, param):
    r = post(fake[1][server], body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tools_are_served_where_they_need_no_parser(fake):
    router, (_, no_auto, plain), _ = fake
    router.pieces, router.reason = ["</think>x"], common_pb2.FINISH_REASON_STOP
    assert post(no_auto, {"tools": TOOLS, "tool_choice": "none"}).status_code == 200
    r = post(plain, {"tools": TOOLS, "tool_choice": "none"})  # no parsers: all content, no reasoning field
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == {"role": "assistant", "content": "</think>x"}


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C"},
]
RENDERED = (  # the template above, rendered by hand for CONVERSATION with TOOLS
    "<|im_start|>system\n# Tools\n\nYou may call these functions:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n</tools>\n\nTo call one, write <tool_call>\n<function=NAME>\n<parameter=PARAM>\nVALUE\n</parameter>\n"
      "</function>\n</tool_call>\n\nBe brief.<|im_end|>\n"
      "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
      "<|im_start|>assistant\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
      "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n")


def rendered(url: str, body: dict) -> str:
    r = requests.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return requests.post(url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]


def check_rendering(url: str) -> None:
    """/tokenize renders what /v1/chat/completions would: the tools, the calls, the tool results, thinking."""
    assert rendered(url, {"messages": CONVERSATION, "tools": TOOLS}) == RENDERED + "<think>\n"
    off = rendered(url, {"messages": CONVERSATION, "tools": TOOLS,
                         "chat_template_kwargs": {"enable_thinking": False}})
    assert off == RENDERED + "<think>\n\n</think>\n\n"


def test_rendered_prompt(fake):
    check_rendering(fake[1][0])
    router = fake[0]
    router.pieces, router.reason = ["</think>x"], common_pb2.FINISH_REASON_STOP
    assert post(fake[1][0], {"messages": CONVERSATION, "tools": TOOLS}).status_code == 200
    tok = fake[2]
    assert tok.decode(list(router.last.token_ids.ids)) == RENDERED + "<think>\n"  # what the engine was sent


# ---- tandem serve: the plumbing end to end ------------------------------------------------------------------------
ENGINE = ["--dtype", "float32", "--num-speculative-tokens", "2", "--block-size", "4", "--max-model-len", "1024",
          "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def served(request, model_dir):
    prefill = "0" if request.param == "colocated" else "1"
    cluster = Cluster("--model", model_dir, "--served-model-name", "m", "--prefill-workers", prefill, *ENGINE)
    try:
        yield f"http://{cluster.http}"
    finally:
        assert cluster.stop() == 0


@pytest.mark.parametrize("thinking", [True, False])
def test_serve_with_tools(served, thinking):
    """The default flags on a Qwen3.5 model: tools with tool_choice auto are served; the rendered prompt is the
    template's; streamed and non-streamed greedy answers agree field by field."""
    check_rendering(served)
    kw = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True,
                                                          "chat_template_kwargs": {"enable_thinking": thinking}})
    full, reason = ask(served, False, messages=CONVERSATION, **kw)
    parts, stream_reason = ask(served, True, messages=CONVERSATION, **kw)
    assert reason == stream_reason == "length" and full["calls"] == parts["calls"] == []
    assert (full["content"], full["reasoning"]) == (parts["content"], parts["reasoning"])
    # tandem-tiny writes no </think>: with thinking on the answer is all reasoning, with it off all content
    assert bool(full["reasoning"]) is thinking and bool(full["content"]) is not thinking


# ---- the flags -------------------------------------------------------------------------------------------------------
def router_parsers(*flags: str, model_type: str = "qwen3_5_moe") -> Parsers:
    """The router's parsers after `tandem serve FLAGS` passed its flags on."""
    serve_ap, router_ap = argparse.ArgumentParser(), argparse.ArgumentParser()
    launch_args(serve_ap)
    router_args(router_ap)
    forwarded = parser_argv(serve_ap.parse_args(list(flags)))
    return Parsers.from_args(router_ap.parse_args(forwarded), model_type)


def test_parser_flags():
    assert router_parsers() == Parsers("qwen3", "qwen3_coder", True)  # on by default for Qwen3.5 / Qwen3-Next
    assert router_parsers(model_type="qwen3_next") == Parsers("qwen3", "qwen3_coder", True)
    assert router_parsers(model_type="llama") == Parsers(None, None, False)
    assert router_parsers("--no-enable-auto-tool-choice") == Parsers("qwen3", "qwen3_coder", False)
    assert router_parsers("--tool-call-parser", "none", "--reasoning-parser", "none") == Parsers(None, None, False)
    assert router_parsers("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                          model_type="llama") == Parsers(None, "qwen3_coder", True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        router_parsers("--enable-auto-tool-choice", "--tool-call-parser", "none")


def test_constraints_start_after_the_thinking(fake):
    """A constraint (here response_format, or the grammar tool_choice required demands) reaches the router with
    `after_think` when the rendered prompt opens the thinking and the reasoning parser is on; the answer's JSON
    then follows the reasoning."""
    router, (parsed, _, plain), _ = fake
    router.pieces, router.reason = ["</think>\n\n", '{"a": 1}'], common_pb2.FINISH_REASON_STOP
    for url, thinking, after in ((parsed, True, True), (parsed, False, False), (plain, True, False)):
        r = post(url, {"response_format": {"type": "json_object"},
                       "chat_template_kwargs": {"enable_thinking": thinking}})
        so = router.last.sampling.structured_outputs
        assert r.status_code == 200 and so.json_object and so.after_think is after, (url, thinking)
    assert json.loads(r.json()["choices"][0]["message"]["content"].removeprefix("</think>\n\n")) == {"a": 1}
    post(parsed, {"tools": TOOLS, "tool_choice": "required"})
    so = router.last.sampling.structured_outputs
    assert so.after_think and so.grammar.startswith("start: call") and "<function=get_weather>" in so.grammar
