"""One chat choice's output, as OpenAI's chat API returns it: the generated text split into `reasoning_content`,
`content` and `tool_calls`, piece by piece for streaming (`feed` -> the delta of each piece) and whole for the final
message (`message()`). Streamed and non-streamed answers come from the same parsers, so they agree.

A tool call written inside the thinking is moved to `tool_calls` (and out of the reasoning text), like one written
in the answer: an agent acts on the calls, wherever the model put them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from router.reasoning import ReasoningParser
from router.tool_calls import ToolCallParser


@dataclass
class OutputFormat:
    """How a request's output is parsed. `tools`: function name -> parameter properties, or None (no tool
    parsing: no tools, `tool_choice` none, or no tool-call parser); `parallel`: more than one call kept."""
    reasoning: bool = False
    prompt_in_think: bool = False
    tools: dict | None = None
    parallel: bool = True


@dataclass
class ChatChoice:
    fmt: OutputFormat
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)

    def __post_init__(self):
        self._think = ReasoningParser(self.fmt.prompt_in_think) if self.fmt.reasoning else None
        self._calls = None
        if self.fmt.tools is not None:  # one parser per part: a call may sit in either
            self._calls = (ToolCallParser(self.fmt.tools), ToolCallParser(self.fmt.tools))

    def feed(self, text: str) -> dict:
        """The delta for `text`, the next piece of the output: any of `reasoning_content`, `content`, `tool_calls`."""
        return self._delta(*(self._think.feed(text) if self._think else ("", text)), final=False)

    def finish(self) -> dict:
        """The delta of whatever the parsers held back, at the end of the output."""
        reasoning, content = self._think.finish() if self._think else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        calls = []
        if self._calls is not None:
            parts = []
            for parser, text in zip(self._calls, (reasoning, content)):
                text, found = parser.feed(text)
                if final:
                    rest, more = parser.finish()
                    text, found = text + rest, found + more
                parts.append(text)
                calls += found
            reasoning, content = parts
        delta = {}
        if reasoning:
            self.reasoning += reasoning
            delta["reasoning_content"] = reasoning
        if content:
            self.content += content
            delta["content"] = content
        # parallel_tool_calls false: the first call only, as vLLM does
        new = [self._call(name, args) for name, args in calls if self.fmt.parallel or not self.tool_calls]
        if new:
            delta["tool_calls"] = new
        return delta

    def _call(self, name: str, args: dict) -> dict:
        call = {"index": len(self.tool_calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
        self.tool_calls.append(call)
        return call

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's reason, except that an answer that stopped after calling tools ends with `tool_calls`."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.fmt.reasoning:
            msg["reasoning_content"] = self.reasoning or None
        if self.tool_calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
        return msg
