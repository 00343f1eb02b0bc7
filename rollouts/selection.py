"""Stage `filter/advantages`: where each group of a step is decided, once → the `groups`,
`decisions` and `advantages` tables.

The over-sampling buffer (rollouts/group_buffer.py, driven by rollouts/source.py) fills the
step's batch and says what it did with every group it saw (`Fill`); this stage decides each
group's fate at the step from it (rollouts/fates.py `select_step`: trained, carried, or dropped
as zero_variance, stale or over_cap, and why), the completions left out before grouping
(reward_error, truncated, filtered), and the trained completions' advantages. `groups.status` is
each group's fate at that step; a carried group gets a second row at the step that trains or
drops it, so a group's last row is its final fate. The per-completion form is the `decisions`
table behind the `fates` view. The `rollout/fate_*` counters are counted from the same decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rlpipe.rollouts.advantages import AdvantageOptions, Group, group_row
from rlpipe.rollouts.fates import Fill, GroupFate, Selection, select_step
from rlpipe.rollouts.generation import step_of_group
from rlpipe.rollouts.records import Rollout
from rlpipe.storage.stage_tables import StageTable, load_rows, stage


def with_stored_rows(groups: list[Group], rows: Mapping[str, Rollout], run_dir: Path) -> dict[str, Rollout]:
    """`rows` and the rollout rows of groups carried across a resume, read from the tables of
    the steps that sampled them; FileNotFoundError when a group's rows are in neither."""
    out = dict(rows)
    for group in groups:
        if group.sample_ids[0] not in out:
            for row in load_rows(run_dir, "rollouts", step_of_group(group.group_id)) or []:
                out[row["sample_id"]] = Rollout.from_row(row)
    missing = [g.group_id for g in groups if g.sample_ids[0] not in out]
    if missing:
        raise FileNotFoundError(f"rollouts of carried-over group(s) {missing[:3]} are not in the tables")
    return out


def group_rows(fates: list[GroupFate], *, run_id: str, step: int) -> list[dict]:
    """The `groups` rows of a step's decision: one per group decided at the step."""
    return [{"run_id": run_id, "step": step, **group_row(f.group), "kept": f.status == "trained", "status": f.status}
            for f in fates]


def advantage_rows(selection: Selection, *, run_id: str, step: int) -> list[dict]:
    """The `advantages` rows of a step's decision: one per trained completion."""
    return [{"run_id": run_id, "step": step, "sample_id": s.sample_id, "group_id": s.rollout.group_id,
             "advantage": s.advantage} for s in selection.samples]


def _empty_when_unsampled(selection: Selection, arguments: Mapping) -> list[dict] | None:
    # carried-over groups alone fed the step: its sampling tables are empty
    return [] if arguments["empty"] else None


FILTER_TABLES = (
    StageTable("rollouts", rows=_empty_when_unsampled),
    StageTable("scores", rows=_empty_when_unsampled),
    StageTable("groups", rows=lambda sel, a: group_rows(sel.fates, run_id=a["run_id"], step=a["step"])),
    StageTable("decisions", rows=lambda sel, a: sel.decisions),
    StageTable("advantages", rows=lambda sel, a: advantage_rows(sel, run_id=a["run_id"], step=a["step"])),
    StageTable("curriculum", rows=lambda sel, a: a["fill"].rested or None),
)
"""What the stage writes. It always runs: its decision is a pure function of the buffer's fill,
which a resumed step repeats from the checkpoint's data_state."""


@stage("filter", tables=FILTER_TABLES)
def filter_stage(fill: Fill, rows: Mapping[str, Rollout], options: AdvantageOptions, *, run_dir: Path,
                 run_id: str, step: int, empty: bool) -> Selection:
    """Decide the step's groups and completions and the trained ones' advantages (module docstring);
    `empty`: no sampling round ran at the step."""
    return select_step(fill, with_stored_rows(fill.batch, rows, run_dir), options, step=step)
