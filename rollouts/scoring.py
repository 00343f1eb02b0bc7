"""Stage `score`: rollouts → rewards → the `scores` table.

A reward function that raises is recorded in `scores.error` with reward 0; once more than
`ScoreOptions.max_error_fraction` of a step's completions raised, the step fails with the first traceback.

The reward calls run in this process, or, with `ScoreOptions.remote` (tasks/cluster.py, the
`[cluster]` section), in batches of consecutive rollouts on a cluster's workers; either way the
rows are built here, in the rollouts' order, so the `scores` table is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlpipe.envs.base import Environment, Example, RewardResult
from rlpipe.envs.multiturn import transcript_of, with_turn_rewards
from rlpipe.envs.rewards import RewardError, format_traceback
from rlpipe.rollouts.records import Rollout, Score
from rlpipe.storage.stage_tables import StageTable, stage


def reward_of(env: Environment, example: Example, transcript: str | list[dict]) -> RewardResult:
    """The env's reward of one completion (or an episode's messages); an env whose own reward()
    raises is recorded as an error with reward 0 (the one scoring path of training rollouts and evals)."""
    try:
        return env.reward(example, transcript)
    except Exception as exc:  # noqa: BLE001 - recorded, and counted against max_error_fraction
        return RewardResult(0.0, {}, format_traceback(exc))


class RemoteScoring(Protocol):
    """Runs `batch_rewards(env, examples, rollouts)` of each batch elsewhere (tasks/cluster.py):
    one list of results per batch, in the batches' order; raises if a batch is lost."""

    batch_size: int
    """Rollouts per batch."""

    def __call__(self, env: Environment, batches: list[tuple[dict[str, Example], list[Rollout]]],
                 ) -> list[list[RewardResult]]: ...


@dataclass(frozen=True)
class ScoreOptions:
    """How a run scores its rollouts (built once per run)."""

    max_error_fraction: float = 0.0
    """The share of a round's reward calls that may raise before the step fails."""
    length_penalty: Callable[[int], float] | None = None
    """DAPO's overlong penalty on the reward, of the completion's tokens (rl.scoring.overlong_buffer), or None."""
    remote: RemoteScoring | None = None
    """Where the reward calls run in batches ([cluster]), or None: in this process."""


def score_rollouts(
    env: Environment, examples: dict[str, Example], rollouts: list[Rollout], options: ScoreOptions,
) -> list[Score]:
    """One `scores` row per rollout row, in the same order. `options.length_penalty(completion
    tokens)` is added to the reward and kept as the `overlong_penalty` component (DAPO)."""
    max_error_fraction, length_penalty = options.max_error_fraction, options.length_penalty
    rows, errors = [], []
    for rollout, result in zip(rollouts, round_rewards(env, examples, rollouts, options.remote), strict=True):
        if result.error is not None:
            errors.append((rollout.sample_id, result.error))
        components = {k: float(v) for k, v in result.components.items()}
        reward = float(result.reward)
        if length_penalty is not None:
            components["overlong_penalty"] = length_penalty(len(rollout.completion_tokens))
            reward += components["overlong_penalty"]
        rows.append(Score(run_id=rollout.run_id, step=rollout.step, sample_id=rollout.sample_id,
                          group_id=rollout.group_id, reward=reward, components=components, error=result.error))
    if rollouts and len(errors) / len(rollouts) > max_error_fraction:
        sample_id, first = errors[0]
        raise RewardError(
            f"{len(errors)} of {len(rollouts)} reward calls raised (limit "
            f"{max_error_fraction:.0%}); first, for sample {sample_id}:\n{first}"
        )
    return rows


def round_rewards(env: Environment, examples: dict[str, Example], rollouts: list[Rollout],
                  remote: RemoteScoring | None) -> list[RewardResult]:
    """One result per rollout, in order: `batch_rewards` of the whole round here, or of batches of
    `remote.batch_size` consecutive rollouts on the cluster, put back together in order."""
    if remote is None or not rollouts:
        return batch_rewards(env, examples, rollouts)
    size = remote.batch_size
    batches = [rollouts[i:i + size] for i in range(0, len(rollouts), size)]
    parts = remote(env, [({r.example_id: examples[r.example_id] for r in b}, b) for b in batches])
    for index, (batch, part) in enumerate(zip(batches, parts, strict=True)):
        if len(part) != len(batch):
            raise RuntimeError(f"score batch {index + 1} of {len(batches)} came back with {len(part)} results "
                               f"for {len(batch)} rollouts")
    return [result for part in parts for result in part]


def batch_rewards(env: Environment, examples: dict[str, Example], rollouts: list[Rollout]) -> list[RewardResult]:
    """One result per rollout: batched where the env scores batches (model rewards,
    envs/reward_models.py), else one reward_of each; per-turn rewards of episodes added."""
    batch = [examples[r.example_id] for r in rollouts]
    transcripts = [transcript_of(r.messages, r.completion_text, r.answer_text) for r in rollouts]
    if callable(getattr(env, "reward_batch", None)):
        try:
            results = env.reward_batch(batch, transcripts)
        except Exception as exc:  # noqa: BLE001 - a batch scorer that raises fails every row, recorded
            results = [RewardResult(0.0, {}, format_traceback(exc))] * len(rollouts)
    else:
        results = [reward_of(env, e, t) for e, t in zip(batch, transcripts, strict=True)]
    return [with_turn_rewards(result, [t["reward"] for t in r.turns or []])
            for r, result in zip(rollouts, results, strict=True)]


def _stored_scores(rows: list[dict], arguments: dict) -> list[Score] | None:
    """The round's scores when a resumed step's partition already holds every one of them."""
    rollouts = arguments["rollouts"]
    wanted = {r.sample_id for r in rollouts}
    existing = {row["sample_id"]: Score.from_row(row) for row in rows if row["sample_id"] in wanted}
    if len(existing) != len(wanted):
        return None
    return [existing[r.sample_id] for r in rollouts]


SCORES = StageTable(
    "scores", rows=lambda new, a: [r.row() for r in a["previous"] + new], read_back=_stored_scores,
    known=lambda a: len(a["previous"]))
"""The step's partition holds the scores of every round so far (`previous`, then this one)."""


@stage("score", tables=(SCORES,))
def score_stage(env: Environment, examples: dict[str, Example], rollouts: list[Rollout], options: ScoreOptions,
                *, previous: list[Score], run_dir: Path, run_id: str, step: int) -> list[Score]:
    """Scores of one sampling round; read back when a resumed step already scored them."""
    return score_rollouts(env, examples, rollouts, options)
