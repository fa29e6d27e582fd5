"""Which parsers split a chat answer (vLLM's flags): `--reasoning-parser` (thinking -> `reasoning_content`),
`--tool-call-parser` (tool calls -> `tool_calls`) and `--enable-auto-tool-choice` (`tool_choice: auto` served).

Unlike vLLM, all three default on for the Qwen3.5 / Qwen3-Next model types this server runs, which think and call
tools in these formats: `tandem serve --model X` answers an agent's tool request without extra flags. `none` /
`--no-enable-auto-tool-choice` turn them off (then `tool_choice: auto` is refused, as vLLM refuses it by default).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "none")
TOOL_CALL_PARSERS = ("qwen3_coder", "none")
QWEN_TYPES = ("qwen3_5", "qwen3_next")  # prefixes of the model types whose outputs these parsers read


@dataclass(frozen=True)
class Parsers:
    reasoning: str | None = None  # None: off
    tool_call: str | None = None
    auto_tool_choice: bool = False

    @classmethod
    def from_args(cls, args, model_type: str) -> "Parsers":
        qwen = model_type.startswith(QWEN_TYPES)
        reasoning = args.reasoning_parser or ("qwen3" if qwen else "none")
        tool_call = args.tool_call_parser or ("qwen3_coder" if qwen else "none")
        auto = args.enable_auto_tool_choice
        if auto and tool_call == "none":
            raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser")
        if auto is None:
            auto = tool_call != "none" and qwen
        return cls(None if reasoning == "none" else reasoning, None if tool_call == "none" else tool_call, auto)


def add_parser_args(ap) -> None:
    ap.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                    help="split the thinking text into reasoning_content (default: qwen3 for Qwen3.5 / Qwen3-Next)")
    ap.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                    help="parse tool calls into tool_calls (default: qwen3_coder for Qwen3.5 / Qwen3-Next)")
    ap.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                    help="serve tool_choice auto (default: on when the tool-call parser is on)")


def parser_argv(args) -> list[str]:
    """The parser flags of `args` that were set, as argv, for a launcher passing them on to the router."""
    out = []
    if args.reasoning_parser is not None:
        out += ["--reasoning-parser", args.reasoning_parser]
    if args.tool_call_parser is not None:
        out += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice is not None:
        out.append("--enable-auto-tool-choice" if args.enable_auto_tool_choice else "--no-enable-auto-tool-choice")
    return out
