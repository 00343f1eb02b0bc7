"""Tool calls in a model's own text format, parsed into OpenAI `tool_calls` and written back.

One parser per output format, chosen by name as vLLM's `--tool-call-parser` chooses one:

    hermes      Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
                block per call; the text before the first block is the reply's content. A last
                block cut off before `</tool_call>` (max_tokens) still counts when its JSON is
                whole. Any block whose JSON is not an object with a string "name" and an object
                "arguments" (or "parameters") makes the whole reply plain content, no calls (as
                vLLM's hermes parser does). The chat template renders the calls of earlier
                assistant turns itself (Qwen3's does), so `to_text` leaves them to it.
    calculator  the calculator tool-use environment (envs/calculator.py): a turn that starts with
                "calc" is one call of the `calc` tool, its `expression` being the rest of the turn.
                Its chat template knows nothing of tool calls, so `to_text` writes an assistant
                message's calls back as the text the model wrote ("calc 37*48").

`parse(text)` gives a `ParsedReply` (content, calls); the server (engines/chat_api.py) and the
multi-turn environments use the same parser, so an agent trained here is served with its tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedReply:
    """An assistant reply split into its text content and its tool calls (in order)."""

    content: str
    calls: tuple[ToolCall, ...] = ()


class ToolCallParser(Protocol):
    """A model's tool-call format."""

    name: str

    def parse(self, text: str) -> ParsedReply:
        """The reply's content and tool calls (no calls: the whole text is content)."""
        ...

    def to_text(self, content: str, calls: list[ToolCall]) -> str | None:
        """The text the model writes for an assistant message with these calls; None when the
        chat template renders tool calls itself."""
        ...


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (Qwen3, Hermes); see the module docstring."""

    name = "hermes"

    def parse(self, text: str) -> ParsedReply:
        """Content before the first block, then one call per block."""
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedReply(text)
        calls = []
        for match in _HERMES_BLOCK.finditer(text, start):
            call = _json_call(match.group(1) if match.group(1) is not None else match.group(2))
            if call is None:
                return ParsedReply(text)
            calls.append(call)
        return ParsedReply(text[:start].strip(), tuple(calls))

    def to_text(self, content: str, calls: list[ToolCall]) -> str | None:
        """Left to the chat template (Qwen3's renders `tool_calls`)."""
        return None


def _json_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], arguments)


CALC_TOOL = "calc"
CALC_PREFIX = "calc"


class CalculatorParser:
    """The calculator environment's "calc EXPRESSION" turns; see the module docstring."""

    name = "calculator"

    def parse(self, text: str) -> ParsedReply:
        """One `calc` call when the stripped turn starts with "calc", else plain content."""
        stripped = text.strip()
        if not stripped.startswith(CALC_PREFIX):
            return ParsedReply(text)
        expression = stripped[len(CALC_PREFIX):].strip()
        return ParsedReply("", (ToolCall(CALC_TOOL, {"expression": expression}),))

    def to_text(self, content: str, calls: list[ToolCall]) -> str | None:
        """"calc EXPRESSION" for the first call (the model makes one call per turn)."""
        if not calls:
            return content
        expression = calls[0].arguments.get("expression", "")
        return f"{CALC_PREFIX} {expression}"


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "calculator": CalculatorParser()}


def get_parser(name: str) -> ToolCallParser:
    """The parser called `name`; ValueError naming the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def openai_tool_calls(calls: tuple[ToolCall, ...], ids: list[str]) -> list[dict[str, Any]]:
    """Calls in OpenAI's `message.tool_calls` shape (arguments as a JSON string)."""
    return [
        {"id": call_id, "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
        for call, call_id in zip(calls, ids, strict=True)
    ]


def calls_of_message(message: dict[str, Any]) -> list[ToolCall]:
    """An OpenAI assistant message's `tool_calls` as ToolCalls; ValueError naming what is wrong."""
    calls = []
    for i, raw in enumerate(message.get("tool_calls") or []):
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool_calls[{i}] needs function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as err:
                raise ValueError(f"tool_calls[{i}].function.arguments is not JSON: {err}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON object")
        calls.append(ToolCall(function["name"], arguments))
    return calls
