"""Tools from MCP servers in episodes: any environment's episodes may call the tools of Model
Context Protocol servers (`[[task.mcp_servers]]`, envs/config.py), served by an `McpToolbox`
(envs/mcp_toolbox.py: the servers, their transports, and how a call's failures are answered).

    env = with_mcp_tools(inner, servers, ToolUseOptions(max_turns=4))   # the servers start here
    ...
    env.close()                               # every server closed, no process left behind

`McpToolsEnv` gives an environment these tools: `tools` (what envs/multiturn.py hands the chat
template as `tools=`), `max_turns` above 1 so episodes are multi-turn, and a `step` that runs the
calls of an assistant turn (parsed by `tool_call_parser`, models/tool_calls.py) in order and
appends one tool message per call. A turn without calls (or calling a tool of the wrapped
environment's own `tools`) goes to the wrapped environment's own `step` (a single-turn
environment ends the episode there, and its reward judges the last assistant message). A Hermes
`<tool_call>` block that is not a call at all is answered as a `bad_call` error. Each tool message
records its call under `tool_call` (server, name, arguments, error, seconds), kept in the
rollouts table's `messages` column with the rest of the episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlpipe.envs.base import Environment, Example, Messages, RewardResult, Split, StepResult
from rlpipe.envs.config import McpServerConfig
from rlpipe.envs.mcp_toolbox import McpToolbox, ToolOutcome
from rlpipe.models.tool_calls import ToolCall, get_parser


@dataclass(frozen=True)
class ToolUseOptions:
    """How an environment with MCP tools runs its episodes (`task.tool_max_turns`,
    `task.tool_call_parser`)."""

    max_turns: int = 4
    """Assistant turns per episode (at least the wrapped environment's own)."""
    parser: str = "hermes"
    """The model's tool-call format (models/tool_calls.py)."""

    def __post_init__(self) -> None:
        if self.max_turns < 2:
            raise ValueError(f"tool_max_turns must be >= 2 (a call and an answer), got {self.max_turns}")
        get_parser(self.parser)


class McpToolsEnv:
    """An environment whose episodes may call the toolbox's tools; see the module docstring."""

    def __init__(self, env: Environment, toolbox: McpToolbox, options: ToolUseOptions | None = None) -> None:
        self.env, self.toolbox = env, toolbox
        self.options = options or ToolUseOptions()
        self.parser = get_parser(self.options.parser)
        self.max_turns = max(self.options.max_turns, getattr(env, "max_turns", 1))
        self.rollout_context = getattr(env, "rollout_context", "tokens")
        own = list(getattr(env, "tools", None) or [])
        self._own_tools = {tool["function"]["name"] for tool in own}
        self.tools = [*own, *toolbox.tools]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    @property
    def name(self) -> str:
        """The wrapped environment's name."""
        return self.env.name

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """The wrapped environment's examples."""
        return self.env.examples(split, seed)

    def reset(self, example: Example) -> Messages:
        """The wrapped environment's first messages."""
        return self.env.reset(example)

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        """The turn's tool calls answered as tool messages (episode goes on), or, for a turn
        without calls or calling the wrapped environment's own tools, the wrapped environment's
        step. A Hermes `<tool_call>` block that is not a call is answered as a `bad_call` error."""
        calls = self.parser.parse(completion_text).calls
        if not calls and self.parser.name == "hermes" and "<tool_call>" in completion_text:
            return StepResult(messages_to_append=[bad_call_message()], done=False)
        if not calls or any(call.name in self._own_tools for call in calls):
            return self.env.step(example, messages, completion_text)
        return StepResult(messages_to_append=[tool_message(self.toolbox.call(call.name, call.arguments), call)
                                              for call in calls], done=False)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        """The wrapped environment's reward of the episode."""
        return self.env.reward(example, transcript)

    def close(self) -> None:
        """Close the MCP servers (and the wrapped environment, if it closes)."""
        self.toolbox.close()
        inner = getattr(self.env, "close", None)
        if callable(inner):
            inner()


def tool_message(outcome: ToolOutcome, call: ToolCall) -> dict[str, Any]:
    """The tool message of one call: what the model reads, and the call's record (`tool_call`)."""
    return {"role": "tool", "name": call.name, "content": outcome.text, "tool_call": outcome.record()}


def bad_call_message() -> dict[str, Any]:
    """The answer to a `<tool_call>` block whose JSON is not {"name": ..., "arguments": {...}}."""
    text = 'error: a <tool_call> block must hold one JSON object {"name": ..., "arguments": {...}}'
    return {"role": "tool", "content": text, "tool_call": {
        "server": "", "name": "", "arguments": {}, "error": "bad_call", "seconds": 0.0}}


def with_mcp_tools(env: Environment, servers: Sequence[McpServerConfig],
                   options: ToolUseOptions | None = None) -> Environment:
    """`env` with the tools of `servers` (itself when there are none); the servers start here."""
    if not servers:
        return env
    return McpToolsEnv(env, McpToolbox(servers), options)  # type: ignore[return-value]
