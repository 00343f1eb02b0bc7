"""The config section of the task (`[task]`): the environment, its options and the reward models
added to its reward (envs/reward_models.py).

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes it into a run's
`RunConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from rlpipe.core.config import Section


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


class TaskConfig(Section):
    """`[task]`: the environment and its rewards."""

    env: str = "arithmetic"
    """Environment name: arithmetic | calculator | code | countdown | dataset | verifiers."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Environment options (e.g. digits, operators, path, prompt_column); checked by the env."""
    eval_examples: int = Field(200, ge=1)
    """Held-out prompts used for greedy evaluation."""
    reward_models: list[RewardModelConfig] = Field(default_factory=list)
    """Model rewards added to the environment's (envs/reward_models.py), each a scores component."""
    env_reward_weight: float = 1.0
    """Weight of the environment's own reward when reward_models are set."""
    reward_timeout_s: float = Field(0.0, ge=0)
    """Seconds one reward call may take (0 = no limit). A call over it is recorded as a reward
    error (reward 0), counted in the share that fails a step (rl.max_reward_error_fraction)."""
