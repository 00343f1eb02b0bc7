"""Every sampled completion's fate: one status and a human reason per `rollouts` row.

The rollout source decides fates at two levels; this module turns both into `decisions` rows
(sample_id, group_id, status, reason; the writer adds run_id and the decision step), one per
completion and decision step:

- per completion, before grouping (`sample_drop`): `reward_error` (the reward function raised:
  its made-up reward of 0 is not trained on), `truncated` (cut at max_new_tokens, with
  rl.drop_truncated), `filtered` (the user filter rl.sample_filter returned False or a reason);
- per group, by the over-sampling buffer (`decision_rows`): `trained`, `carried` (valid surplus
  waiting for a later step), `zero_variance`, `stale` (too old, or replaced by a newer group of
  the same example), `over_cap` (sampled by a step that used up rl.max_attempts without filling
  its batch: the step failed and the run stopped).

A carried group gets another row at the step that trains or drops it, so the newest row of a
sample is its fate: storage/views.py's `fates` view takes it. `fate_metrics` are the
`rollout/fate_<status>` counters of a step, counted from the same rows.

Plain Python, no Prefect and no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from rlpipe.core.user_code import import_user_object
from rlpipe.training import metric_names as m

if TYPE_CHECKING:
    from rlpipe.rollouts.records import Rollout, Score
    from rlpipe.training.advantages import Group
    from rlpipe.training.config import RLConfig
    from rlpipe.training.oversampling import GroupDecision

STATUSES = ("trained", "zero_variance", "stale", "carried", "over_cap", "reward_error", "truncated", "filtered")


@functools.cache
def user_filter(spec: str) -> Callable[[Rollout, Score], bool | str]:
    """The function a "module:function" spec names; ValueError naming the spec otherwise."""
    fn = import_user_object(spec, "rl.sample_filter")
    if not callable(fn):
        raise ValueError(f"rl.sample_filter must name a function as 'module:function', got {spec!r}")
    return fn


def sample_drop(rollout: Rollout, score: Score, rl: RLConfig) -> tuple[str, str] | None:
    """(status, reason) when the completion is left out of its group before selection, else None."""
    if score.error is not None:
        first = score.error.splitlines()[0] if score.error else "no message"
        return "reward_error", f"reward function raised: {first}"
    if rl.drop_truncated and rollout.finish_reason == "length":
        return "truncated", (f"cut at rl.sampling.max_new_tokens={rl.sampling.max_new_tokens} "
                             "(finish_reason 'length') and rl.drop_truncated is on")
    if rl.sample_filter:
        verdict = user_filter(rl.sample_filter)(rollout, score)
        if verdict is not True:
            why = verdict if isinstance(verdict, str) and verdict else "returned False"
            return "filtered", f"{rl.sample_filter}: {why}"
    return None


def _row(sample_id: str, group_id: str, status: str, reason: str) -> dict:
    assert status in STATUSES, status
    return {"sample_id": sample_id, "group_id": group_id, "status": status, "reason": reason}


def drop_rows(drops: Iterable[tuple[Rollout, str, str]]) -> list[dict]:
    """The rows of completions dropped before grouping: (rollout, status, reason) each."""
    return [_row(r.sample_id, r.group_id, status, reason) for r, status, reason in drops]


def over_cap(decisions: list[GroupDecision], reason: str) -> list[GroupDecision]:
    """The decisions of a step that failed to fill its batch: its valid groups become over_cap."""
    return [replace(d, status="over_cap", reason=reason) if d.status == "valid" else d for d in decisions]


def decision_rows(batch: list[Group], decisions: list[GroupDecision], *, step: int) -> list[dict]:
    """One row per completion of every group decided at `step`: the batch's groups are trained,
    a valid group not taken is carried, the others keep their decision's status and reason."""
    final: dict[str, tuple[Group, str, str]] = {}
    for d in decisions:  # a group decided twice in one step (added, then replaced) keeps the last
        if d.status == "valid":
            status, reason = "carried", f"valid surplus beyond step {step}'s batch, waits for a later step"
        else:
            status, reason = d.status, d.reason
        final[d.group.group_id] = (d.group, status, reason)
    for g in batch:
        final[g.group_id] = (g, "trained", f"trained at step {step} (sampled by policy version {g.policy_version})")
    return [_row(sid, g.group_id, status, reason)
            for g, status, reason in final.values() for sid in g.sample_ids]


def fate_metrics(rows: list[dict], pending: Iterable[Group]) -> dict[str, float]:
    """rollout/fate_<status>: completions whose fate `rows` decided at this step, per status;
    rollout/fate_carried is every completion still waiting in the buffer after the step (so the
    last step's value is the count of `carried` fates)."""
    out = {m.fate(status): 0.0 for status in STATUSES}
    for row in rows:
        if row["status"] != "carried":
            out[m.fate(row["status"])] += 1
    out[m.fate("carried")] = float(sum(len(g.sample_ids) for g in pending))
    return out
