"""Typed rollout records for tests that only care about a few of their fields."""

from __future__ import annotations

from typing import Any

from rlpipe.rollouts.records import Rollout, TrainSample

_DEFAULTS: dict[str, Any] = dict(
    run_id="r", step=1, policy_version=0, env="test", example_id="x", group_id="g", sample_id="s", attempt=1,
    prompt_tokens=[], completion_tokens=[], completion_logprobs=[], finish_reason="stop", prompt_text="",
    completion_text="", n_prompt_tokens=0, n_completion_tokens=0,
)


def rollout(**fields: Any) -> Rollout:
    """A Rollout with `fields` set and placeholders elsewhere."""
    return Rollout(**(_DEFAULTS | fields))


def train_sample(advantage: float, reward: float = 1.0, **fields: Any) -> TrainSample:
    return TrainSample(rollout(**fields), reward=reward, advantage=advantage)
