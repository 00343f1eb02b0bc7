"""Stage `score`: rollouts → rewards → the `scores` table.

A reward function that raises is recorded in `scores.error` with reward 0; once more than
`max_error_fraction` of a step's completions raised, the step fails with the first traceback.
"""

from __future__ import annotations

from envs.base import Environment, Example
from tasks._prefect import stage


class RewardError(RuntimeError):
    """Too many reward calls raised in one step."""


def score_rollouts(
    env: Environment, examples: dict[str, Example], rollouts: list[dict], max_error_fraction: float
) -> list[dict]:
    """One `scores` row per rollout row, in the same order."""
    rows, errors = [], []
    for rollout in rollouts:
        example = examples[rollout["example_id"]]
        result = env.reward(example, rollout["completion_text"])
        if result.error is not None:
            errors.append((rollout["sample_id"], result.error))
        rows.append(
            {
                "run_id": rollout["run_id"],
                "step": rollout["step"],
                "sample_id": rollout["sample_id"],
                "group_id": rollout["group_id"],
                "reward": float(result.reward),
                "components": {k: float(v) for k, v in result.components.items()},
                "error": result.error,
            }
        )
    if rollouts and len(errors) / len(rollouts) > max_error_fraction:
        sample_id, first = errors[0]
        raise RewardError(
            f"{len(errors)} of {len(rollouts)} reward calls raised (limit "
            f"{max_error_fraction:.0%}); first, for sample {sample_id}:\n{first}"
        )
    return rows


@stage("score")
def score_task(env, examples, rollouts, max_error_fraction) -> list[dict]:
    return score_rollouts(env, examples, rollouts, max_error_fraction)
