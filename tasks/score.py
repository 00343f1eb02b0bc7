"""Stage `score`: rollouts → rewards → the `scores` table.

A reward function that raises is recorded in `scores.error` with reward 0; once more than
`max_error_fraction` of a step's completions raised, the step fails with the first traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from envs.base import Environment, Example, RewardResult
from envs.rewards import RewardError, format_traceback
from tasks._prefect import stage
from tasks.record import load_rows_beyond, persist


def score_rollouts(
    env: Environment, examples: dict[str, Example], rollouts: list[dict], max_error_fraction: float,
    length_penalty: Callable[[int], float] | None = None,
) -> list[dict]:
    """One `scores` row per rollout row, in the same order. `length_penalty(completion tokens)` is
    added to the reward and kept as the `overlong_penalty` component (DAPO)."""
    rows, errors = [], []
    for rollout in rollouts:
        example = examples[rollout["example_id"]]
        try:
            result = env.reward(example, rollout["completion_text"])
        except Exception as exc:  # noqa: BLE001 - an env whose own reward() raises is recorded too
            result = RewardResult(0.0, {}, format_traceback(exc))
        if result.error is not None:
            errors.append((rollout["sample_id"], result.error))
        components = {k: float(v) for k, v in result.components.items()}
        reward = float(result.reward)
        if length_penalty is not None:
            components["overlong_penalty"] = length_penalty(len(rollout["completion_tokens"]))
            reward += components["overlong_penalty"]
        rows.append(
            {
                "run_id": rollout["run_id"],
                "step": rollout["step"],
                "sample_id": rollout["sample_id"],
                "group_id": rollout["group_id"],
                "reward": reward,
                "components": components,
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
def score_stage(env: Environment, examples: dict[str, Example], rollouts: list[dict], *,
                previous: list[dict], run_dir: Path, run_id: str, step: int,
                max_error_fraction: float, length_penalty: Callable[[int], float] | None = None) -> list[dict]:
    """Scores of one sampling round; read back when a resumed step already scored them."""
    wanted = {row["sample_id"] for row in rollouts}
    stored = load_rows_beyond(run_dir, "scores", step, known=len(previous)) or []
    existing = [row for row in stored if row["sample_id"] in wanted]
    if len(existing) == len(wanted):
        order = {row["sample_id"]: row for row in existing}
        return [order[row["sample_id"]] for row in rollouts]
    rows = score_rollouts(env, examples, rollouts, max_error_fraction, length_penalty)
    persist(run_dir, "scores", step, previous + rows, run_id)
    return rows
