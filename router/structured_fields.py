"""A request's output constraint over HTTP: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`),
vLLM's `structured_outputs` field (`json`, `regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`),
and on chat a `tool_choice` of `required` or a named function, which constrains the output to Qwen3.5's tool-call
format (router/tool_grammar.py). At most one constraint per request; each is compiled here (cached), so an invalid
schema, regex or grammar is a 400 with the parser's message before anything is queued.
"""

from __future__ import annotations

import json

from router.http_errors import bad
from tandem.rpc import common_pb2
from tandem.rpc.convert import structured_to_proto
from tandem.structured import StructuredOutputs, grammar_spec

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_OPTIONS = ("disable_any_whitespace",)


def constraint(body: dict, tool_grammar: str | None = None) -> common_pb2.StructuredOutputs | None:
    """The request's constraint on the wire, or None; a 400 naming the field when it is malformed or invalid.
    `tool_grammar`: the grammar a chat request's tool_choice demands (None: none)."""
    found, options = [], {}
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'structured_outputs' must be an object", "structured_outputs")
        unknown = set(so) - set(_KINDS) - set(_OPTIONS)
        if unknown:
            raise bad(f"'structured_outputs' does not support {sorted(unknown)} (supported: "
                      f"{', '.join(_KINDS + _OPTIONS)})", "structured_outputs")
        kinds = {k: v for k, v in so.items() if k in _KINDS and v not in (None, False)}
        if len(kinds) > 1:
            raise bad(f"'structured_outputs' takes one of {', '.join(_KINDS)}, got {sorted(kinds)}",
                      "structured_outputs")
        if kinds:
            found.append(("structured_outputs", _checked_kind(*next(iter(kinds.items())))))
        for k in _OPTIONS:
            if k in so and not isinstance(so[k], bool):
                raise bad(f"'structured_outputs.{k}' must be a boolean", "structured_outputs")
            options[k] = bool(so.get(k))
    if tool_grammar is not None:
        found.append(("tool_choice", {"grammar": tool_grammar}))
    if len(found) > 1:
        raise bad(f"only one output constraint per request, got {' and '.join(n for n, _ in found)}", found[1][0])
    if not found:
        return None
    param, kind = found[0]
    try:
        so = StructuredOutputs(**kind, **options)
        grammar_spec(so)
    except ValueError as e:
        raise bad(f"'{param}': {e}", param) from None
    return structured_to_proto(so)


def _response_format(rf) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                  "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"json_object": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
        raise bad("'response_format' json_schema needs {\"name\": ..., \"schema\": a JSON schema object}",
                  "response_format")
    if not isinstance(js.get("strict", False), (bool, type(None))):
        raise bad("'response_format.json_schema.strict' must be a boolean", "response_format")
    # strict or not, the schema is enforced (as vLLM does)
    return {"json": json.dumps(js.get("schema", {}))}


def _checked_kind(kind: str, value) -> dict:
    ok = {"json": lambda v: isinstance(v, (str, dict, bool)), "json_object": lambda v: v is True,
          "regex": lambda v: isinstance(v, str), "grammar": lambda v: isinstance(v, str),
          "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) for c in v)}[kind]
    if not ok(value):
        what = {"json": "a JSON schema (object or string)", "json_object": "true", "regex": "a string",
                "grammar": "a string", "choice": "a non-empty list of strings"}[kind]
        raise bad(f"'structured_outputs.{kind}' must be {what}", "structured_outputs")
    return {kind: json.dumps(value) if kind == "json" and not isinstance(value, str) else value}
