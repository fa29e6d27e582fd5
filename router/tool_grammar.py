"""`tool_choice` `required` or a named function as a grammar (llguidance's Lark): the output is one or more tool
calls in Qwen3.5's format (what router/tool_calls.py parses), each naming an offered function, with every
parameter its schema requires (optional ones may follow, in the schema's order), each value valid against its
schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A string parameter is written raw, as the format does: one of its `enum` values, a match of its `pattern`, or else
any text without `<` or a line break (so it cannot close its tag early) within `minLength` / `maxLength`. Every
other value is compact JSON for its schema (`%json`), which the parser types back by the schema.
"""

from __future__ import annotations

import json

_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def tool_call_grammar(tools: list[dict], named: str | None, parallel: bool) -> str:
    """tools: OpenAI function tools; named: the function tool_choice names (None: `required`, any of them);
    parallel: more than one call allowed."""
    funcs = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    rules = []
    for i, f in enumerate(funcs):
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        required = params.get("required")
        required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        parts = []
        for j, (name, schema) in enumerate(props.items()):
            rules.append(f"p_{i}_{j}: {_lit(f'<parameter={name}>' + chr(10))} {_value(schema)} "
                         f"{_lit(chr(10) + '</parameter>' + chr(10))}")
            parts.append(f"p_{i}_{j}" if name in required else f"p_{i}_{j}?")
        head = _lit(f"<tool_call>\n<function={f['name']}>\n")
        rules.append(f"call_{i}: {head} {' '.join(parts)} {_lit('</function>' + chr(10) + '</tool_call>')}")
    call = " | ".join(f"call_{i}" for i in range(len(funcs)))
    start = "start: call (\"\\n\" call)*" if parallel else "start: call"
    return "\n".join([start, f"call: {call}", *rules]) + "\n"


def _lit(s: str) -> str:
    return json.dumps(s)


def _value(schema) -> str:
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(_lit(v) for v in schema["enum"]) + ")"
        if isinstance(schema.get("pattern"), str):  # the whole value matches it (so a search finds it too)
            return "/" + schema["pattern"].replace("/", "\\/") + "/"
        lo, hi = _count(schema.get("minLength")) or 0, _count(schema.get("maxLength"))
        return f"/[^<\\n]{{{lo},{'' if hi is None else max(hi, lo)}}}/"
    return "%json " + json.dumps({**schema, **_COMPACT})


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
