"""The tool fields of a chat request, checked: `tools` (OpenAI function tools), `tool_choice`, `parallel_tool_calls`,
and the assistant messages' `tool_calls` made ready for the chat template. Every bad shape is a 400 naming its field.

    tools = request_tools(body)            # shape only (/tokenize takes the same fields)
    tools.check_servable(auto_enabled, parser)   # what this server can do with them (/v1/chat/completions)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.http_errors import bad

CHOICES = ("none", "auto", "required")


@dataclass
class Tools:
    tools: list[dict] | None  # as the chat template takes them (None: no tools)
    choice: str  # none, auto, required, or "named"
    named: str | None
    parallel: bool

    def schemas(self) -> dict:
        """Function name -> its parameters' properties, for typing the arguments of parsed calls."""
        out = {}
        for t in self.tools or ():
            params = t["function"].get("parameters") or {}
            out[t["function"]["name"]] = params.get("properties") or {}
        return out

    def parsed(self) -> bool:
        """Whether the output is searched for tool calls."""
        return self.tools is not None and self.choice != "none"

    def check_servable(self, auto_enabled: bool, parser: str | None) -> None:
        if not self.parsed():
            return
        if parser is None:
            raise bad(f"tool_choice '{self.choice}' needs a tool-call parser: start the server with "
                      "--tool-call-parser", "tool_choice")
        if self.choice == "auto" and not auto_enabled:
            raise bad("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and "
                      "--tool-call-parser", "tool_choice")


def _function_tool(t) -> bool:
    f = t.get("function") if isinstance(t, dict) else None
    return (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict)
            and isinstance(f.get("name"), str) and f["name"] != ""
            and isinstance(f.get("description", ""), (str, type(None)))
            and isinstance(f.get("parameters", {}), (dict, type(None)))
            and isinstance((f.get("parameters") or {}).get("properties", {}), (dict, type(None)))
            and isinstance(f.get("strict", False), (bool, type(None))))


def request_tools(body: dict) -> Tools:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_function_tool(t) for t in tools):
            raise bad("'tools' must be a list of function tools: {\"type\": \"function\", \"function\": {\"name\": "
                      "a non-empty string, \"description\": a string, \"parameters\": a JSON schema object}}", "tools")
        tools = tools or None
    names = {t["function"]["name"] for t in tools or ()}
    choice, named = body.get("tool_choice"), None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad("a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": NAME}}",
                      "tool_choice")
        if f["name"] not in names:
            raise bad(f"'tool_choice' names the function {f['name']!r}, which is not in 'tools'", "tool_choice")
        choice, named = "named", f["name"]
    elif choice not in CHOICES:
        raise bad(f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise bad("'tool_choice' 'required' needs 'tools'", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' has the wrong type: {type(parallel).__name__}", "parallel_tool_calls")
    return Tools(tools, choice, named, parallel is not False)


def template_message(m: dict) -> dict:
    """An assistant message's `tool_calls` with their JSON `arguments` parsed (chat templates iterate over them);
    other messages unchanged."""
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, list):
        raise bad("'tool_calls' of a message must be a list", "messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad("each of a message's 'tool_calls' needs a 'function' with a 'name'", "messages")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise bad(f"the arguments of the tool call to {f['name']!r} are not valid JSON", "messages") from None
        if not isinstance(args, dict):
            raise bad(f"the arguments of the tool call to {f['name']!r} must be a JSON object", "messages")
        out.append(dict(c, function=dict(f, arguments=args)))
    return dict(m, tool_calls=out)
