"""Stage `score`: rollouts → rewards → the `scores` table.

A reward function that raises is recorded in `scores.error` with reward 0; once more than
`max_error_fraction` of a step's completions raised, the step fails with the first traceback.
"""

from __future__ import annotations

from pathlib import Path

from envs.base import Environment, Example, RewardResult
from envs.multiturn import row_transcript, with_turn_rewards
from envs.rewards import RewardError, format_traceback
from tasks._prefect import stage
from tasks.record import load_rows_beyond, persist


def score_rollouts(
    env: Environment, examples: dict[str, Example], rollouts: list[dict], max_error_fraction: float
) -> list[dict]:
    """One `scores` row per rollout row, in the same order."""
    rows, errors = [], []
    for rollout, result in zip(rollouts, _rewards(env, examples, rollouts), strict=True):
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


def _rewards(env: Environment, examples: dict[str, Example], rollouts: list[dict]) -> list[RewardResult]:
    """One result per rollout: batched where the env scores batches (model rewards,
    envs/reward_models.py), else one call each; per-turn rewards of episodes added."""
    batch = [examples[r["example_id"]] for r in rollouts]
    transcripts = [row_transcript(r) for r in rollouts]
    try:
        if callable(getattr(env, "reward_batch", None)):
            results = env.reward_batch(batch, transcripts)
        else:
            results = [_one(env, e, t) for e, t in zip(batch, transcripts, strict=True)]
    except Exception as exc:  # noqa: BLE001 - a batch scorer that raises fails every row, recorded
        results = [RewardResult(0.0, {}, format_traceback(exc))] * len(rollouts)
    return [with_turn_rewards(result, [t["reward"] for t in r.get("turns") or []])
            for r, result in zip(rollouts, results, strict=True)]


def _one(env: Environment, example: Example, transcript) -> RewardResult:
    try:
        return env.reward(example, transcript)
    except Exception as exc:  # noqa: BLE001 - an env whose own reward() raises is recorded too
        return RewardResult(0.0, {}, format_traceback(exc))


@stage("score")
def score_stage(env: Environment, examples: dict[str, Example], rollouts: list[dict], *,
                previous: list[dict], run_dir: Path, run_id: str, step: int,
                max_error_fraction: float) -> list[dict]:
    """Scores of one sampling round; read back when a resumed step already scored them."""
    wanted = {row["sample_id"] for row in rollouts}
    stored = load_rows_beyond(run_dir, "scores", step, known=len(previous)) or []
    existing = [row for row in stored if row["sample_id"] in wanted]
    if len(existing) == len(wanted):
        order = {row["sample_id"]: row for row in existing}
        return [order[row["sample_id"]] for row in rollouts]
    rows = score_rollouts(env, examples, rollouts, max_error_fraction)
    persist(run_dir, "scores", step, previous + rows, run_id)
    return rows
