"""Qwen3.5 tool calls (router/tool_calls.py) and a chat choice's full split into reasoning, content and tool calls
(router/chat_choice.py), on outputs written from the format's description (the one vLLM's qwen3_coder parser reads),
fed whole, cut at every point and at many random points: the result never depends on where the stream broke."""

import json
import random

import pytest

from router.chat_choice import ChatChoice, OutputFormat
from router.tool_calls import ToolCallParser, typed

WEATHER = {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
           "ratio": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array"},
           "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}
TOOLS = {"get_weather": WEATHER, "search": {"query": {"type": "string"}}}


def call(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(text: str, cuts=(), **fmt) -> tuple[dict, list[dict]]:
    """The final message, and the streamed deltas, of `text` cut at `cuts`."""
    choice = ChatChoice(OutputFormat(**{"tools": TOOLS, **fmt}))
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [choice.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [choice.finish()]
    return choice.message(), deltas


def streamed(deltas: list[dict]) -> dict:
    """What an OpenAI client assembles from the deltas."""
    out = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", ()):
            slot = out["tool_calls"].setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] += c.get("id", "")
            slot["name"] += c["function"].get("name", "")
            slot["arguments"] += c["function"].get("arguments", "")
    out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return out


def cuts_of(text: str):
    rng = random.Random(len(text))
    yield ()
    yield from ((i,) for i in range(1, len(text)))
    for k in (2, 3, 6, 12):
        for _ in range(15):
            yield rng.sample(range(1, len(text)), min(k, len(text) - 1))
    yield range(1, len(text))


def check(text: str, content, calls, thinking=None, **fmt):
    """Every split of `text` gives `content` (None: absent), `calls` [(name, arguments)] and the reasoning text
    `thinking` (None: absent)."""
    for cuts in cuts_of(text):
        msg, deltas = run(text, cuts, **fmt)
        assert msg["content"] == content, cuts
        assert msg.get("reasoning_content") == thinking, cuts
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
        assert got == calls, cuts
        s = streamed(deltas)
        assert s["content"] == (content or "") and s["reasoning_content"] == (thinking or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in s["tool_calls"]] == calls
        assert [c["id"] for c in s["tool_calls"]] == [c["id"] for c in msg.get("tool_calls", [])]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg.get("tool_calls", []))


def test_one_call_typed_by_the_schema():
    text = call("get_weather", city="Paris", days="3", metric="true", ratio="0.5")
    check(text, None, [("get_weather", {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5})])


def test_text_around_several_calls():
    text = ("Let me look.\n" + call("get_weather", city="Rome") + "\n" + call("search", query="news")
            + "\nDone.")
    check(text, "Let me look.\n\n\nDone.", [("get_weather", {"city": "Rome"}), ("search", {"query": "news"})])


def test_multi_line_and_json_values():
    where = '{"lat": 48.85,\n "lon": [2, 3]}'
    text = call("get_weather", city="New\nYork\n\n(São Paulo, 東京 😀)", where=where, tags='["a", "b"]', note="null",
                limit="null")
    check(text, None, [("get_weather", {"city": "New\nYork\n\n(São Paulo, 東京 😀)",
                                        "where": {"lat": 48.85, "lon": [2, 3]},
                                        "tags": ["a", "b"], "note": None, "limit": None})])


def test_values_that_do_not_fit_the_schema_stay_strings():
    text = call("get_weather", days="three", metric="yes", where="{not json", unknown="42") + call("nope", x="1")
    check(text, None, [("get_weather", {"days": "three", "metric": "yes", "where": "{not json", "unknown": "42"}),
                       ("nope", {"x": "1"})])


def test_call_inside_the_thinking_is_moved_to_tool_calls():
    text = "I need the weather.\n" + call("get_weather", city="Oslo") + "\n</think>\n\nChecking."
    check(text, "Checking.", [("get_weather", {"city": "Oslo"})], thinking="I need the weather.\n\n",
          reasoning=True, prompt_in_think=True)
    # and after an opening tag the model wrote itself; a call in the answer keeps its place in the order
    text = "<think>" + call("search", query="a") + "</think>" + call("search", query="b")
    check(text, None, [("search", {"query": "a"}), ("search", {"query": "b"})], reasoning=True)


def test_reasoning_with_a_split_end_tag_and_no_tools():
    check("thinking</think>\n\nanswer", "answer", [], thinking="thinking", reasoning=True, prompt_in_think=True,
          tools=None)


def test_unterminated_call_at_length_is_content():
    text = "Sure. <tool_call>\n<function=search>\n<parameter=query>\nhal"
    check(text, text, [])


def test_tool_choice_none_leaves_calls_as_content():
    text = "a " + call("search", query="x")
    check(text, text, [], tools=None)


def test_parallel_tool_calls_false_keeps_the_first():
    text = call("search", query="1") + call("search", query="2")
    check(text, None, [("search", {"query": "1"})], parallel=False)


def test_tags_that_are_not_calls_stay_text():
    text = "write <tool_call> without a function </tool_call> or <tool_ca and </function> alone"
    check(text, text, [])


def test_closing_tags_left_out():
    # a parameter closed only by the next one, and a block without </tool_call>
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</function>\nok"
    check(text, "\nok", [("get_weather", {"city": "Lima", "days": 2})])


def test_finish_reason():
    choice = ChatChoice(OutputFormat(tools=TOOLS))
    choice.feed(call("search", query="q"))
    assert choice.finish_reason("stop") == "tool_calls" and choice.finish_reason("length") == "length"
    assert ChatChoice(OutputFormat(tools=TOOLS)).finish_reason("stop") == "stop"


@pytest.mark.parametrize("value,schema,want", [
    ("7", {"type": "integer"}, 7), ("7.0", {"type": "integer"}, 7), ("7.5", {"type": "integer"}, "7.5"),
    ("-1e3", {"type": "number"}, -1000.0), ("True", {"type": "boolean"}, True), ("true", {"type": "string"}, "true"),
    ("[1]", {"type": "object"}, "[1]"), ("{}", {"type": "object"}, {}), (" x ", None, " x "),
    ("5", {"type": ["null", "integer"]}, 5), ("5", {"anyOf": [{"type": "integer"}]}, "5"),
    ("true", {"type": "integer"}, "true"), ("[" * 5000, {"type": "array"}, "[" * 5000),
])
def test_typed(value, schema, want):
    got = typed(value, schema)
    assert got == want and type(got) is type(want)


def test_parser_alone_returns_text_and_calls():
    p = ToolCallParser({"f": {"n": {"type": "integer"}}})
    text, calls = p.feed("x<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>y")
    assert (text, calls, p.finish()) == ("xy", [("f", {"n": 1})], ("", []))
