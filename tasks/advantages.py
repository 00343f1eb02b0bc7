"""Stage `filter/advantages`: the groups the rollout source took for a step (and what it did with
every other group) → the `groups` and `advantages` tables.

The selection itself (zero-variance filter, carry-over, staleness) is training/oversampling.py,
driven by rollouts/source.py; this stage records its decisions. `groups.status` is each group's
fate at that step: trained, carried (valid, waits for a later step), zero_variance, stale
(dropped for age), or over_cap (the step failed at rl.max_attempts). A carried group gets a second
row at the step that trains or drops it, so a group's last row is its final fate. The per-completion form, with a reason and the completions
dropped before grouping (reward errors, truncation), is the `decisions` table behind the `fates`
view (rollouts/fates.py).
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.rollouts.records import Rollout
from rlpipe.tasks._prefect import stage
from rlpipe.tasks.record import load_rows, persist
from rlpipe.training.advantages import Group, group_row
from rlpipe.training.oversampling import GroupDecision


def step_of_group(group_id: str) -> int:
    """The step that sampled a group (ids are `<run>:s<step>:a<attempt>:g<index>`)."""
    return int(group_id.rsplit(":", 3)[1][1:])


def load_group_rows(groups: list[Group], rows: dict[str, Rollout], run_dir: Path) -> None:
    """Add to `rows` the rollout rows of carried groups sampled before a resume (from the tables)."""
    for group in groups:
        if group.sample_ids[0] not in rows:
            for row in load_rows(run_dir, "rollouts", step_of_group(group.group_id)) or []:
                rows[row["sample_id"]] = Rollout.from_row(row)
    missing = [g.group_id for g in groups if g.sample_ids[0] not in rows]
    if missing:
        raise FileNotFoundError(f"rollouts of carried-over group(s) {missing[:3]} are not in the tables")


def group_rows(batch: list[Group], decisions: list[GroupDecision], carried: list[Group], *,
               run_id: str, step: int) -> list[dict]:
    """One row per group decided at this step, and per carried group trained at it."""
    taken = {g.group_id for g in batch}

    def row(group: Group, status: str) -> dict:
        return {"run_id": run_id, "step": step, **group_row(group), "kept": status == "trained",
                "status": status}

    last = {d.group.group_id: d for d in decisions}  # decided twice in a step (added, replaced): the last
    rows = []
    for d in last.values():
        status = d.status if d.status != "valid" else "trained" if d.group.group_id in taken else "carried"
        rows.append(row(d.group, status))
    decided = {d.group.group_id for d in decisions}
    rows += [row(g, "trained") for g in carried if g.group_id in taken and g.group_id not in decided]
    return rows


@stage("filter")
def select_task(batch, decisions, carried, samples, fates: list[dict], *, run_dir: Path, run_id: str,
                step: int) -> None:
    persist(run_dir, "groups", step, group_rows(batch, decisions, carried, run_id=run_id, step=step), run_id)
    persist(run_dir, "decisions", step, fates, run_id)
    advantage_rows = [{"run_id": run_id, "step": step, "sample_id": s.sample_id,
                       "group_id": s.rollout.group_id, "advantage": s.advantage} for s in samples]
    persist(run_dir, "advantages", step, advantage_rows, run_id)
