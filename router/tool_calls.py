"""Tool calls in Qwen3.5's output format (the one vLLM's `qwen3_coder` parser reads), split from the text around them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

    p = ToolCallParser({"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}}})
    text, calls = p.feed(piece)   # for each piece of the output, split anywhere
    text, calls = p.finish()      # at the end

Each call is `(name, arguments)`, the arguments a dict whose values are typed by the tool's JSON schema: a parameter
declared integer, number, boolean, object, array or null is parsed as such when its text is one; anything else
(a string parameter, an unknown one, a value that does not parse) stays the text. A call is settled when its
`</function>` arrives. A call still open when the output ends (it ran out of tokens) is returned as text, as vLLM
does: half a call is no call.
"""

from __future__ import annotations

import json
import re

from router.tag_scan import partial_tag

OPEN, CLOSE, FUNCTION_END = "<tool_call>", "</tool_call>", "</function>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
# a parameter's value ends at its closing tag; models sometimes leave that out before the next parameter or the end
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_OUT, _IN, _AFTER = "out", "in", "after"


def typed(value: str, schema) -> object:
    """`value` as the parameter's JSON schema types it, or the text itself."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    s = value.strip()
    if "null" in kinds and s == "null":  # a nullable parameter's null, even when it may also be a string
        return None
    for kind in kinds:
        if kind == "string":
            return value
        if kind == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            try:
                v = json.loads(s)
            except (ValueError, RecursionError):  # not this kind (or nested past the parser's limit)
                continue
            want = {"integer": int, "number": (int, float), "object": dict, "array": list}[kind]
            if kind == "integer" and isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, want) and not isinstance(v, bool):
                return v
    return value


def parse_call(body: str, schemas: dict) -> tuple[str, dict] | None:
    """One call from the text between `<tool_call>` and `</function>` (or `</tool_call>`); None if it names no
    function."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    properties = schemas.get(name) or {}
    args = {}
    for p in _PARAMETER.finditer(body, m.end()):
        value = p.group(2)
        # the value sits on lines of its own: the newline after the opening tag and before the closing one are layout
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        pname = p.group(1).strip()
        args[pname] = typed(value, properties.get(pname) if isinstance(properties, dict) else None)
    return name, args


class ToolCallParser:
    """`schemas`: function name -> its parameters' `properties` (for typing the arguments)."""

    def __init__(self, schemas: dict):
        self.schemas = schemas
        self._state = _OUT
        self._held = ""  # text not settled yet: a possible start of a tag, or the body of an open call

    def feed(self, text: str) -> tuple[str, list[tuple[str, dict]]]:
        buf, out, calls = self._held + text, [], []
        self._held = ""
        while buf:
            if self._state == _OUT:
                start = buf.find(OPEN)
                if start < 0:
                    keep = partial_tag(buf, OPEN)
                    out.append(buf[:len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    break
                out.append(buf[:start])
                self._state, buf = _IN, buf[start + len(OPEN):]
            elif self._state == _IN:
                ends = [(i, tag) for tag in (FUNCTION_END, CLOSE) if (i := buf.find(tag)) >= 0]
                if not ends:
                    self._held = buf
                    break
                end, tag = min(ends)
                call = parse_call(buf[:end], self.schemas)
                if call is None:  # not a call after all: the text stays text
                    out.append(OPEN + buf[:end + len(tag)])
                else:
                    calls.append(call)
                self._state, buf = (_AFTER if tag == FUNCTION_END and call else _OUT), buf[end + len(tag):]
            else:  # after `</function>`: `</tool_call>`, or another function in the same block
                lead = buf.lstrip()
                if lead.startswith(CLOSE):
                    self._state, buf = _OUT, lead[len(CLOSE):]
                elif lead.startswith("<function="):
                    self._state, buf = _IN, lead
                elif CLOSE.startswith(lead) or "<function=".startswith(lead):
                    self._held = buf
                    break
                else:  # the block was never closed: carry on with the text
                    self._state = _OUT
        return "".join(out), calls

    def finish(self) -> tuple[str, list[tuple[str, dict]]]:
        """What was held back: an open call is text again (with its `<tool_call>`); blanks after a call are dropped."""
        held, state = self._held, self._state
        self._held, self._state = "", _OUT
        if state == _IN:
            return OPEN + held, []
        return ("" if state == _AFTER else held), []
