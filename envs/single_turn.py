"""`SingleTurnEnv`: the base of single-turn verifiable tasks (envs/base.py states the protocol).

One user prompt, one completion, then done; the reward is the task's `score`, called through
envs/rewards.py's safe evaluation so that a raising score is recorded, not raised.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlpipe.envs.base import (
    Example,
    Messages,
    RewardResult,
    Split,
    StepResult,
    completion_text_of,
    prompt_messages,
)
from rlpipe.envs.rewards import evaluate_reward


class SingleTurnEnv:
    """Base for single-turn verifiable tasks: one user prompt, one completion, then done.

    Subclasses set `name` and implement `examples` and `score(example, completion_text)`; `reward`
    wraps `score` so that an exception becomes `RewardResult(0.0, error=traceback)`.
    """

    name: str = "single_turn"

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        raise NotImplementedError

    def reset(self, example: Example) -> Messages:
        return prompt_messages(example)

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        return StepResult(messages_to_append=[], done=True)

    def score(
        self, example: Example, completion_text: str
    ) -> float | tuple[float, dict[str, float]]:
        raise NotImplementedError

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        text = completion_text_of(transcript)
        return evaluate_reward(lambda t, _a, ex: self.score(ex, t), text, example.answer, example)
