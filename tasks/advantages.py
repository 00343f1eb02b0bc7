"""Stage `filter/advantages`: scored groups → zero-variance filter, over-sampling buffer,
advantages → the `groups` and `advantages` tables.

The buffer (training/oversampling.py) keeps surplus valid groups for the next step; their rollout
rows stay in memory, and after a resume they are read back from the step that sampled them.
"""

from __future__ import annotations

import math
from pathlib import Path

from tasks._prefect import stage
from tasks.record import load_rows, persist
from training.advantages import AdvantageConfig, group_advantages, group_row, make_groups
from training.oversampling import BufferConfig, GroupBuffer, GroupDecision


def new_buffer(rl) -> GroupBuffer:
    return GroupBuffer(BufferConfig(
        groups_per_batch=rl.prompts_per_step, oversample_factor=rl.oversample_factor,
        max_attempts=rl.max_attempts, max_staleness=rl.max_staleness,
        drop_zero_variance=rl.drop_zero_variance))


def advantage_config(rl) -> AdvantageConfig:
    return AdvantageConfig(estimator=rl.estimator, normalize_std=rl.normalize_std,
                           positive_only=rl.positive_only)


def prompts_to_sample(buffer: GroupBuffer, max_boost: float = 8.0) -> int:
    """Prompts for the next sampling round: the buffer's `need × oversample_factor`, scaled up by
    the share of sampled groups that turned out valid (this batch's, else the run's so far), so
    that a policy which solves most prompts (many zero-variance groups) still fills its batch in
    a round or two instead of shrinking rounds."""
    base = buffer.prompts_to_sample()
    counts = buffer.batch_counts if buffer.batch_counts["sampled_groups"] else buffer.total_counts
    if not counts["sampled_groups"]:
        return base
    valid_share = max(counts["valid_groups"] / counts["sampled_groups"], 1.0 / max_boost)
    return math.ceil(base / valid_share)


def scored_groups(rollouts: list[dict], scores: list[dict], attempt: int):
    """Groups of one sampling round (rollout rows joined with their rewards)."""
    reward = {row["sample_id"]: row["reward"] for row in scores}
    return make_groups([{**row, "reward": reward[row["sample_id"]]} for row in rollouts], attempt)


def step_of_group(group_id: str) -> int:
    """The step that sampled a group (ids are `<run>:s<step>:a<attempt>:g<index>`)."""
    return int(group_id.rsplit(":", 3)[1][1:])


def rollout_rows_for(groups, rows_by_sample: dict[str, dict], run_dir: Path) -> list[dict]:
    """Rollout rows of the batch's groups; carried groups sampled before a resume are read back."""
    for group in groups:
        if group.sample_ids[0] not in rows_by_sample:
            for row in load_rows(run_dir, "rollouts", step_of_group(group.group_id)) or []:
                rows_by_sample[row["sample_id"]] = row
    missing = [g.group_id for g in groups if g.sample_ids[0] not in rows_by_sample]
    if missing:
        raise FileNotFoundError(f"rollouts of carried-over group(s) {missing[:3]} are not in the tables")
    return [rows_by_sample[sid] | {"reward": reward} for g in groups
            for sid, reward in zip(g.sample_ids, g.rewards, strict=True)]


def filter_and_advantages(
    buffer: GroupBuffer, decisions: list[GroupDecision], config: AdvantageConfig,
    rows_by_sample: dict[str, dict], *, run_dir: Path, run_id: str, step: int,
) -> tuple[list[dict], dict[str, float], dict[str, float], list[dict], list[dict]]:
    """Take the batch from the buffer; returns (rollout rows, advantages, metrics, group rows,
    advantage rows)."""
    batch, metrics = buffer.take()
    taken = {g.group_id for g in batch}
    group_rows = [{"run_id": run_id, "step": step, **group_row(d.group, config.eps),
                   "kept": d.group.group_id in taken} for d in decisions]
    advantages = group_advantages(batch, config)
    advantage_rows = [{"run_id": run_id, "step": step, "sample_id": sid, "group_id": g.group_id,
                       "advantage": advantages[sid]} for g in batch for sid in g.sample_ids]
    rollouts = rollout_rows_for(batch, rows_by_sample, run_dir)
    rewards = [row["reward"] for row in rollouts]
    metrics["rollout/reward_mean"] = sum(rewards) / max(len(rewards), 1)
    metrics["rollout/kept_groups"] = float(len(batch))
    return rollouts, advantages, metrics, group_rows, advantage_rows


@stage("filter")
def filter_task(buffer, decisions, config, rows_by_sample, *, run_dir, run_id, step):
    rollouts, advantages, metrics, group_rows, advantage_rows = filter_and_advantages(
        buffer, decisions, config, rows_by_sample, run_dir=run_dir, run_id=run_id, step=step)
    persist(run_dir, "groups", step, group_rows, run_id)
    persist(run_dir, "advantages", step, advantage_rows, run_id)
    return rollouts, advantages, metrics
