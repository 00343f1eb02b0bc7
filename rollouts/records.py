"""Typed rows passed between the RL stages; their columnar form is the Arrow schema of the table
they are written to (storage/schemas.py; tests/unit/test_records.py keeps the two in step).

    rollout = Rollout.from_row(row)     # a `rollouts` table row (dict) -> typed record
    rows = [r.row() for r in rollouts]  # typed records -> the rows a stage's table writes
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class _Row:
    """`row()` / `from_row()` between a dataclass and a table row dict."""

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.columns()}

    @classmethod
    def from_row(cls, row: dict[str, Any]):
        return cls(**{name: row[name] for name in cls.columns() if name in row})  # absent: the default


@dataclass(frozen=True)
class Rollout(_Row):
    """One sampled completion (a `rollouts` row)."""

    run_id: str
    step: int
    policy_version: int
    """Optimizer steps applied to the weights that sampled it."""
    env: str
    example_id: str
    group_id: str
    sample_id: str
    attempt: int
    """Sampling round of its step (1-based)."""
    prompt_tokens: list[int]
    completion_tokens: list[int]
    completion_logprobs: list[float]
    """The engine's log-prob of each completion token (the behaviour policy)."""
    finish_reason: str
    prompt_text: str
    completion_text: str
    n_prompt_tokens: int
    n_completion_tokens: int
    # multi-turn episodes (envs/multiturn.py); None for single-turn rollouts
    n_turns: int | None = None
    turns: list[dict] | None = None
    """Spans of completion_tokens: turn, producer (model | env | context), start, length, reward."""
    messages: str | None = None
    """The transcript as JSON chat messages."""
    # reasoning and answer told apart (models/chat.py split_thinking_tokens); None for episodes
    thinking_tokens: int | None = None
    """Completion tokens inside `<think>` ... `</think>`, the tags included (0 without a block)."""
    answer_tokens: int | None = None
    """Completion tokens outside the reasoning block."""
    answer_text: str | None = None
    """What the reward sees: the text after `</think>` ('' when cut inside the reasoning)."""
    # partial rollouts (rl.off_policy.partial_rollouts): the versions of the weights that sampled its first
    # and its last token; both default to policy_version (one version sampled it all)
    first_policy_version: int | None = None
    """Version of its oldest token (>= policy_version, the version its round started from)."""
    last_policy_version: int | None = None
    """Version of its newest token."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (rl.teacher): the teacher's log-prob of each completion token."""
    teacher: str | None = None
    """The teacher that scored it: `rl.teacher`, else the served model's name (null: none)."""
    teacher_checkpoint: str | None = None
    """The teacher's checkpoint: its folder in process, the server's model root over HTTP."""
    teacher_url: str | None = None
    """The teacher's server (`rl.distill.url`); null in process."""

    def __post_init__(self) -> None:
        for name in ("first_policy_version", "last_policy_version"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.policy_version)


@dataclass(frozen=True)
class Score(_Row):
    """The reward of one completion (a `scores` row)."""

    run_id: str
    step: int
    sample_id: str
    group_id: str
    reward: float
    components: Any
    """Reward components by name (a dict when computed; as Arrow returns a map when read back)."""
    error: str | None
    """None, or why the reward function failed (the reward is then 0)."""


@dataclass(frozen=True)
class TrainSample:
    """One selected completion, ready to pack: its rollout row, reward and advantage."""

    rollout: Rollout
    reward: float
    advantage: float
    token_advantages: list[float] | None = None
    """Per completion token, where they differ (on-policy distillation); None: `advantage` on each."""

    @property
    def sample_id(self) -> str:
        """The completion's id (its `rollouts` row's sample_id)."""
        return self.rollout.sample_id
