"""Environments: where prompts come from and how completions are judged.

One protocol serves single-turn verifiable tasks (arithmetic, countdown, a prompt dataset) and
multi-turn episodes (tool use, games). The rollout loop owns the conversation; the environment
only answers three questions:

    messages = env.reset(example)                          # initial chat messages
    loop:
        completion_text = <policy samples the assistant turn>
        messages += [{"role": "assistant", "content": completion_text}]
        result = env.step(example, messages, completion_text)
        messages += result.messages_to_append             # environment turn (tool/user reply)
        if result.done: break
    scored = env.reward(example, messages)                 # or the final completion text

Contract:

- `examples(split, seed)` returns the `Example`s of `"train"` or `"eval"` (a `Sequence`: indexable
  and sized, possibly generated lazily). Eval examples are a fixed held-out set, disjoint from train.
- `reset(example)` returns the initial chat messages (`[{"role": "user", "content": ...}]`).
- `step(example, messages, completion_text)`: `messages` is the transcript so far, the new
  assistant turn included. Tokens of environment turns (`messages_to_append`) carry loss weight 0:
  only the policy's own tokens are trained on. Single-turn environments return `done=True` after
  the first completion and append nothing.
- `reward(example, transcript)`: `transcript` is the completion text (single-turn) or the full
  message list. Returns a `RewardResult`; it never raises for a bad completion, and a reward
  function that raises is caught and recorded in `RewardResult.error` (see `envs.rewards`).

A multi-turn environment has a `max_turns` attribute above 1 (and optionally `rollout_context`,
"tokens" or "template"); envs/multiturn.py runs its episodes. Single-turn tasks build on
`SingleTurnEnv` (envs/single_turn.py); envs/registry.py builds an environment by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, overload, runtime_checkable

Split = Literal["train", "eval"]
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Example:
    """One task instance.

    env:        name of the environment that made it
    example_id: stable id, unique within (env, split) and the same on every run with the same config
    prompt:     the user prompt text, or chat messages (list of {"role", "content"} dicts)
    answer:     what the verifier checks against (an int, a string, anything the reward understands)
    meta:       free-form details (difficulty, split, ...) kept for analysis
    curriculum_key: the prompt's class for a curriculum keyed by class (rl.curriculum.key = "class"):
                what makes it hard, shared by many prompts; None = the example_id (its own class)
    """

    env: str
    example_id: str
    prompt: str | list[dict[str, Any]]
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)
    curriculum_key: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What the environment says after an assistant turn.

    messages_to_append: environment turns (tool/user replies) to add to the transcript; loss weight 0
    done:               True when the episode is over (always True for single-turn tasks)
    reward:             optional per-turn reward for the assistant turn just taken; the episode's
                        reward adds these to `reward()` (envs/multiturn.py)
    """

    messages_to_append: list[dict[str, Any]]
    done: bool
    reward: float | None = None


@dataclass(frozen=True)
class RewardResult:
    """A scored completion.

    reward:     the scalar reward (0.0 when the reward function raised)
    components: named parts, e.g. {"format": 1.0, "correct": 0.0}
    error:      None, or the formatted traceback of a reward function that raised
    """

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@runtime_checkable
class Environment(Protocol):
    """See the module docstring for the contract."""

    name: str

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]: ...

    def reset(self, example: Example) -> Messages: ...

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult: ...

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult: ...


def prompt_messages(example: Example) -> Messages:
    """The example's prompt as chat messages (a plain string becomes one user message)."""
    if isinstance(example.prompt, str):
        return [{"role": "user", "content": example.prompt}]
    return [dict(m) for m in example.prompt]


def completion_text_of(transcript: str | Messages) -> str:
    """The text a single-turn verifier judges: the string itself, or the last assistant turn."""
    if isinstance(transcript, str):
        return transcript
    for message in reversed(transcript):
        if message.get("role") == "assistant":
            return str(message.get("content", ""))
    raise ValueError("transcript has no assistant message to score")


class LazyExamples(Sequence[Example]):
    """A read-only sequence of examples generated on access by `make(index)`."""

    def __init__(self, n: int, make: Callable[[int], Example]) -> None:
        self._n, self._make = n, make

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Example: ...
    @overload
    def __getitem__(self, i: slice) -> list[Example]: ...
    def __getitem__(self, i: int | slice) -> Example | list[Example]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"example index {i} out of range [0, {self._n})")
        return self._make(i)


def check_split(split: str) -> Split:
    """`split` validated ('train' or 'eval')."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split  # type: ignore[return-value]


def options_to_config(cls: type, options: dict[str, Any], env_name: str) -> Any:
    """`cls(**options)` with unknown option names reported by name (cls is a dataclass)."""
    known = set(getattr(cls, "__dataclass_fields__", {}))
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) for environment {env_name!r}: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    return cls(**options)
