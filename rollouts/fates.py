"""Every sampled completion's fate: one status and a human reason per `rollouts` row, decided once.

A step's completions are decided at two levels, and this module is where both become fates:

- per completion, before grouping (`sample_drop`): `reward_error` (the reward function raised:
  its made-up reward of 0 is not trained on), `truncated` (cut at max_new_tokens, with
  rl.filter.drop_truncated), `cut_in_thinking` (the same, cut inside its `<think>` block before any
  answer), `filtered` (the user filter rl.filter.sample_filter returned False or a reason);
- per group (`decide_groups`), from what the over-sampling buffer did while filling the batch
  (`Fill`): `trained` (in the step's batch), `carried` (valid surplus waiting for a later step),
  `zero_variance`, `stale` (too old, replaced by a newer group of the same example, or evicted
  from the batch maker's full reservoir),
  `over_cap` (sampled by a step that used up rl.buffer.max_attempts without filling its batch: the step
  failed and the run stopped).

`select_step` is the filter/advantages stage's whole decision: each group's `GroupFate`, the
`decisions` rows of every completion (sample_id, group_id, status, reason; the writer adds run_id
and the decision step) and the trained samples with their advantages. The `groups` table, the
`decisions` table and the `rollout/fate_<status>` counters (`fate_metrics`) are all read off it.
A carried group gets another row at the step that trains or drops it, so the newest row of a
sample is its fate: storage/views.py's `fates` view takes it.

Plain Python, no Prefect and no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rlpipe.core import metric_names as m
from rlpipe.core.user_code import import_user_object
from rlpipe.rollouts.advantages import AdvantageOptions, group_advantages
from rlpipe.rollouts.distill import DistillOptions, mean_advantage, pulls, token_advantages
from rlpipe.rollouts.records import TrainSample

if TYPE_CHECKING:
    from rlpipe.rollouts.advantages import Group
    from rlpipe.rollouts.group_buffer import GroupDecision
    from rlpipe.rollouts.records import Rollout, Score

STATUSES = ("trained", "zero_variance", "stale", "carried", "over_cap", "reward_error", "truncated",
            "cut_in_thinking", "filtered")


def cut_in_thinking(rollout: Rollout) -> bool:
    """Cut at max_new_tokens inside its reasoning block: every token is reasoning, no answer
    (rollouts table: thinking_tokens = n_completion_tokens, finish_reason 'length')."""
    return (rollout.finish_reason == "length" and bool(rollout.thinking_tokens)
            and rollout.thinking_tokens == rollout.n_completion_tokens)


@functools.cache
def user_filter(spec: str) -> Callable[[Rollout, Score], bool | str]:
    """The function a "module:function" spec names; ValueError naming the spec otherwise."""
    fn = import_user_object(spec, "rl.filter.sample_filter")
    if not callable(fn):
        raise ValueError(f"rl.filter.sample_filter must name a function as 'module:function', got {spec!r}")
    return fn


@dataclass(frozen=True)
class DropOptions:
    """What decides a completion's drop before grouping, as the `[rl]` section names it."""

    drop_truncated: bool
    max_new_tokens: int
    """rl.sampling.max_new_tokens, named in a truncated completion's reason."""
    sample_filter: str


def sample_drop(rollout: Rollout, score: Score, options: DropOptions) -> tuple[str, str] | None:
    """(status, reason) when the completion is left out of its group before selection, else None."""
    if score.error is not None:
        first = score.error.splitlines()[0] if score.error else "no message"
        return "reward_error", f"reward function raised: {first}"
    if options.drop_truncated and cut_in_thinking(rollout):
        return "cut_in_thinking", (f"cut at rl.sampling.max_new_tokens={options.max_new_tokens} inside its "
                                   "<think> block, before any answer, and rl.filter.drop_truncated is on")
    if options.drop_truncated and rollout.finish_reason == "length":
        return "truncated", (f"cut at rl.sampling.max_new_tokens={options.max_new_tokens} "
                             "(finish_reason 'length') and rl.filter.drop_truncated is on")
    if options.sample_filter:
        verdict = user_filter(options.sample_filter)(rollout, score)
        if verdict is not True:
            why = verdict if isinstance(verdict, str) and verdict else "returned False"
            return "filtered", f"{options.sample_filter}: {why}"
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


@dataclass(frozen=True)
class GroupFate:
    """A group's decision at a step: its status (a STATUSES group status) and the human reason."""

    group: Group
    status: str
    reason: str


def decide_groups(batch: list[Group], decisions: list[GroupDecision], *, step: int) -> list[GroupFate]:
    """The fate of every group decided at `step`, in the order first decided: the batch's groups
    are trained, a valid group not taken is carried, the others keep their decision's status and
    reason. A group decided twice in one step (added, then replaced) keeps the last decision."""
    final: dict[str, GroupFate] = {}
    for d in decisions:
        if d.status == "valid":
            fate = GroupFate(d.group, "carried", f"valid surplus beyond step {step}'s batch, waits for a later step")
        else:
            fate = GroupFate(d.group, d.status, d.reason)
        final[d.group.group_id] = fate
    for g in batch:  # carried groups from earlier steps too: their row at the step that trains them
        final[g.group_id] = GroupFate(g, "trained",
                                      f"trained at step {step} (sampled by policy version {g.policy_version})")
    return list(final.values())


def fate_rows(fates: Iterable[GroupFate]) -> list[dict]:
    """One `decisions` row per completion of every decided group."""
    return [_row(sid, f.group.group_id, f.status, f.reason) for f in fates for sid in f.group.sample_ids]


@dataclass(frozen=True)
class Fill:
    """What the over-sampling buffer did while filling a step's batch, before anything is decided."""

    batch: list[Group]
    """The groups the buffer gave the step (carried ones first); empty for a failed step."""
    decisions: list[GroupDecision]
    """The buffer's decisions of the step's fill (valid, zero_variance, stale, over_cap)."""
    drops: list[tuple[Rollout, str, str]]
    """Completions left out before grouping: (rollout, status, reason)."""
    rested: list[dict] = field(default_factory=list)
    """Resting prompts the curriculum skipped or re-tested (rollouts/curriculum.py rows)."""


@dataclass(frozen=True)
class Selection:
    """A step's decision (`select_step`): what the filter/advantages stage records and returns."""

    fates: list[GroupFate]
    """Every group decided at the step (the `groups` rows)."""
    decisions: list[dict]
    """Every completion decided at the step (the `decisions` rows): drops first, then by group."""
    samples: list[TrainSample]
    """The completions to train on, group by group in batch order, with their advantages."""


def select_step(fill: Fill, rows: Mapping[str, Rollout], options: AdvantageOptions, *, step: int) -> Selection:
    """Decide every group and completion of a step once, and the trained samples' advantages;
    `rows` holds the rollout row of every completion in the batch."""
    fates = decide_groups(fill.batch, fill.decisions, step=step)
    advantages = group_advantages(fill.batch, options)
    samples = [distilled(TrainSample(rows[sid], reward, advantages[sid]), options.distill) for g in fill.batch
               for sid, reward in zip(g.sample_ids, g.rewards, strict=True)]
    return Selection(fates=fates, decisions=drop_rows(fill.drops) + fate_rows(fates), samples=samples)


def distilled(sample: TrainSample, options: DistillOptions) -> TrainSample:
    """The sample with its per-token advantages under on-policy distillation (rollouts/distill.py);
    its `advantage` (the `advantages` row) becomes their mean. Unchanged without distillation."""
    per_token = token_advantages(sample.advantage, sample.rollout, options)
    if per_token is None:
        return sample
    return TrainSample(sample.rollout, sample.reward, mean_advantage(sample.advantage, pulls(sample.rollout), options),
                       per_token)


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
