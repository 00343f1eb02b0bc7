"""The config section of the task (`[task]`): the environment, its options and the reward models
added to its reward (envs/reward_models.py).

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes it into a run's
`RunConfig`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from rlpipe.core.config import Section, check_shares
from rlpipe.models.tool_calls import PARSERS

ENV_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A mixture entry's name: a hive partition value (`env=NAME`) and a metric path part."""


class RewardModelConfig(Section):
    """One `[[task.reward_models]]` entry: a model whose score adds to the reward."""

    name: str
    """Component name in scores.components (e.g. "rm", "judge")."""
    type: Literal["classifier", "judge"]
    """classifier: a sequence-classification reward model; judge: an LLM judge (torch engine)."""
    path: str
    """classifier: a Hugging Face AutoModelForSequenceClassification folder; judge: a causal LM
    checkpoint folder. Either may be a hub id ORG/NAME[@REVISION], resolved as model.path is."""
    weight: float = 1.0
    """Weight of this score in the reward (reward = env_reward_weight * env reward + sum)."""
    label: int | str | None = None
    """classifier with several labels: the label whose probability is the score (default: the last)."""
    batch_size: int = Field(16, ge=1)
    """classifier: sequences per forward pass."""
    prompt: str = ""
    """judge: prompt with a {conversation} field; '' = envs.reward_models.JUDGE_PROMPT."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables of this model's chat template (a Qwen3 judge: `{ enable_thinking = false }`
    to answer within its few tokens); unset = model.chat_template_kwargs."""


class McpServerConfig(Section):
    """One `[[task.mcp_servers]]` entry: an MCP server whose tools the policy may call
    (envs/mcp_toolbox.py). Give `command` (a stdio server the run starts) or `url` (a streamable
    HTTP server already running), not both."""

    name: str = Field(min_length=1)
    """Name of the server in the record of each call (the `tool_call.server` of a tool message)."""
    command: str = ""
    """stdio: the executable that starts the server (e.g. "python", "npx", "uvx")."""
    args: list[str] = Field(default_factory=list)
    """stdio: its command-line arguments."""
    env: dict[str, str] = Field(default_factory=dict)
    """stdio: environment variables set for the server, over the SDK's safe default set (plain
    values: they are written to config.json; pass secrets with pass_env)."""
    pass_env: list[str] = Field(default_factory=list)
    """stdio: variables of the run's own environment handed to the server by name (API keys: their
    values never enter the config); one that is not set stops the run naming it."""
    cwd: str = ""
    """stdio: the server's working folder ('' = the run's)."""
    url: str = ""
    """streamable HTTP: the server's endpoint (e.g. "http://127.0.0.1:8000/mcp")."""
    headers: dict[str, str] = Field(default_factory=dict)
    """streamable HTTP: headers sent with every request, plain values (written to config.json)."""
    headers_env: dict[str, str] = Field(default_factory=dict)
    """streamable HTTP: headers whose value is read from an environment variable, header name →
    variable name (e.g. { Authorization = "SEARCH_AUTH" }): tokens never enter the config."""
    tools: list[str] | None = None
    """The server's tools the policy sees, by name (unset = all it lists); a name it does not list
    is an error when the run starts."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """Seconds to start (stdio), connect and list the tools before the run fails naming the server."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Seconds one tool call may take; a slower call is answered to the model as a timeout error."""
    max_output_chars: int = Field(4000, ge=1)
    """A tool's reply is cut to this many characters (the cut is said in the reply)."""

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command (stdio) or url (streamable HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: url must start with http:// or https://, got {self.url!r}")
        if self.command and (self.headers or self.headers_env):
            raise ValueError(f"MCP server {self.name!r}: headers and headers_env apply to url servers only")
        if self.url and (self.args or self.env or self.pass_env or self.cwd):
            raise ValueError(f"MCP server {self.name!r}: args, env, pass_env and cwd apply to command servers only")
        return self
class EnvEntryConfig(Section):
    """One `[[task.envs]]` entry: an environment of a mixture, its share of the prompts and its options."""

    name: str
    """The entry's name: the `env` column of its rows, its `env=NAME` partitions, its
    `rollout/NAME/*` metrics. Letters, digits, '_', '.', '-'; unique within the mixture."""
    weight: float = Field(1.0, gt=0)
    """Its share of the prompts: each prompt comes from this entry with probability weight / sum."""
    env: str = "arithmetic"
    """Environment name, as `task.env`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Environment options, as `task.options`."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not ENV_NAME_PATTERN.fullmatch(name):
            raise ValueError(f"name must be letters, digits, '_', '.' or '-' (a partition folder name), got {name!r}")
        return name


class TaskConfig(Section):
    """`[task]`: the environment (or a mixture of several, `[[task.envs]]`) and its rewards."""

    env: str = "arithmetic"
    """Environment name: arithmetic | calculator | code | countdown | dataset | verifiers."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Environment options (e.g. digits, operators, path, prompt_column); checked by the env."""
    envs: list[EnvEntryConfig] = Field(default_factory=list)
    """A mixture: `[[task.envs]]` entries, prompts drawn from them by weight (envs/mixture.py);
    then `env` and `options` stay unset. Empty: the one environment `env` with `options`."""
    eval_examples: int = Field(200, ge=1)
    """Held-out prompts used for greedy evaluation."""
    reward_models: list[RewardModelConfig] = Field(default_factory=list)
    """Model rewards added to the environment's (envs/reward_models.py), each a scores component."""
    env_reward_weight: float = 1.0
    """Weight of the environment's own reward when reward_models are set."""
    reward_timeout_s: float = Field(0.0, ge=0)
    """Seconds one reward call may take (0 = no limit). A call over it is recorded as a reward
    error (reward 0), counted in the share that fails a step (rl.scoring.max_reward_error_fraction)."""
    mcp_servers: list[McpServerConfig] = Field(default_factory=list)
    """MCP servers whose tools the policy may call (envs/mcp_tools.py): episodes become multi-turn,
    the tools are listed to the chat template, each call's result is a tool message."""
    tool_max_turns: int = Field(4, ge=2)
    """With mcp_servers: assistant turns per episode (tool-calling turns plus the final answer),
    unless the environment is multi-turn with more turns of its own."""
    tool_call_parser: str = "hermes"
    """With mcp_servers: the model's tool-call format (models/tool_calls.py), as `rlpipe serve
    --tool-call-parser` names it."""

    @model_validator(mode="after")
    def _mcp_names(self) -> TaskConfig:
        names = [server.name for server in self.mcp_servers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"mcp_servers: server names must be unique, repeated: {', '.join(repeated)}")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: unknown parser {self.tool_call_parser!r}; "
                             f"known: {', '.join(sorted(PARSERS))}")
        return self

    @model_validator(mode="after")
    def _one_form(self) -> TaskConfig:
        if self.envs:
            defaults = {"env": type(self).model_fields["env"].default, "options": {}}
            both = [key for key, default in defaults.items() if getattr(self, key) != default]
            if both:
                raise ValueError(f"task.envs is a mixture: leave task.{' and task.'.join(both)} unset "
                                 "(give each [[task.envs]] entry its env and options)")
            names = [entry.name for entry in self.envs]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"task.envs: names must be unique, {', '.join(twice)} given more than once")
            check_shares([entry.weight for entry in self.envs], names, "task.envs")
        weights = [self.env_reward_weight, *(model.weight for model in self.reward_models)]
        if not math.isfinite(sum(abs(w) for w in weights)):
            raise ValueError(f"task.env_reward_weight and task.reward_models weights ({', '.join(f'{w:g}' for w in weights)}) "
                             "add up past the largest float: rewards would be inf")
        return self

    def entries(self) -> list[EnvEntryConfig]:
        """The environments of the run: the `[[task.envs]]` entries, or the one `[task]` env (a
        mixture of one, named after its environment)."""
        if self.envs:
            return list(self.envs)
        return [EnvEntryConfig(name=self.env, weight=1.0, env=self.env, options=self.options)]
