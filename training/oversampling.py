"""The over-sampling group buffer: fills each step's batch with groups that carry signal.

Over-sampling: a sampling round asks for `oversample_factor ×` the groups still needed (scaled up
by the share of sampled groups that turned out valid), and the buffer drops zero-variance groups,
keeps the valid ones, gives `prompts_per_step` of them to the step and carries the surplus to the
next step. Carried groups more than `staleness_limit` policy versions behind the step being trained
are dropped as stale, and only the latest policy version of each example is kept. After
`max_attempts` rounds without a full batch, `fill` raises `BatchFillError` (or, with
`partial_batches`, returns what it found). Its state is plain JSON (checkpoint data_state.json).

    buffer = GroupBuffer(options)                   # BufferOptions (rollouts/options.py builds them)
    decisions = buffer.fill(version, sample_round)  # sample_round(attempt, n_prompts) -> groups
    batch, metrics = buffer.take()

Plain Python (no torch), like training/advantages.py whose `Group` records it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpipe.training import metric_names as m
from rlpipe.training.advantages import ZERO_VARIANCE_EPS, Group, GroupStats


@dataclass(frozen=True)
class BufferOptions:
    """What the buffer reads of the `[rl]` section (its meaning and defaults are there)."""

    prompts_per_step: int
    oversample_factor: float
    max_attempts: int
    partial_batches: bool
    max_staleness: int
    max_off_policy_steps: int
    drop_zero_variance: bool


class BatchFillError(RuntimeError):
    """The buffer could not collect enough valid groups within max_attempts sampling rounds;
    `decisions` holds what the rounds of the failed batch decided (their groups' fate rows);
    `metrics` the step's rollout/fate_* counters, so the run can log them before it stops."""

    decisions: list[GroupDecision]
    metrics: dict[str, float]


def staleness_limit(options: BufferOptions) -> int:
    """Most policy versions a trained group may lag the weights being updated: the carry-over
    bound `max_staleness`, or the async bound `max_off_policy_steps` when that is larger."""
    return max(options.max_staleness, options.max_off_policy_steps)


_COUNTERS = ("sampled_groups", "zero_var_groups", "valid_groups", "stale_dropped")


@dataclass
class GroupDecision:
    """What the buffer did with one group: status is 'valid', 'zero_variance' or 'stale'
    (dropped for age; `kept` in the groups table says whether a valid group was trained), and
    `reason`, the human text of a drop (the `fates` view, rollouts/fates.py)."""

    group: Group
    stats: GroupStats
    status: str
    reason: str = ""


@dataclass
class GroupBuffer:
    """Valid groups waiting to be trained on, with the counters of the batch being filled."""

    options: BufferOptions
    pending: list[Group] = field(default_factory=list)
    policy_version: int = 0
    attempts: int = 0
    batch_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    total_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))

    def _count(self, name: str, n: int = 1) -> None:
        self.batch_counts[name] += n
        self.total_counts[name] += n

    def start_batch(self, policy_version: int) -> list[GroupDecision]:
        """Begin filling the batch that trains `policy_version`: evict stale carried groups
        (returned as decisions), reset counters."""
        self.policy_version = policy_version
        self.attempts = 0
        self.batch_counts = dict.fromkeys(_COUNTERS, 0)
        limit = staleness_limit(self.options)
        stale = [g for g in self.pending if policy_version - g.policy_version > limit]
        self._count("stale_dropped", len(stale))
        self.pending = [g for g in self.pending if policy_version - g.policy_version <= limit]
        return [GroupDecision(g, g.stats(ZERO_VARIANCE_EPS), "stale",
                              f"policy version {g.policy_version} lags training version {policy_version} by "
                              f"more than the staleness limit {limit}") for g in stale]

    def need(self) -> int:
        """Valid groups still missing for a full batch."""
        return max(0, self.options.prompts_per_step - len(self.pending))

    def prompts_to_sample(self, max_boost: float = 8.0) -> int:
        """Prompts for the next round: ceil(need × oversample_factor), scaled up by the share of
        sampled groups that turned out valid (this batch's, else the run's so far), so that a
        policy which solves most prompts still fills its batch in a round or two."""
        base = math.ceil(self.need() * self.options.oversample_factor)
        counts = self.batch_counts if self.batch_counts["sampled_groups"] else self.total_counts
        if not counts["sampled_groups"]:
            return base
        valid_share = max(counts["valid_groups"] / counts["sampled_groups"], 1.0 / max_boost)
        return math.ceil(base / valid_share)

    def begin_attempt(self) -> int:
        """Count a sampling round (1-based number); BatchFillError once max_attempts are used up."""
        if self.attempts >= self.options.max_attempts:
            c = self.batch_counts
            raise BatchFillError(
                f"could not fill {self.options.prompts_per_step} groups with non-zero reward variance "
                f"after {self.attempts} attempts ({len(self.pending)} valid; of {c['sampled_groups']} "
                f"groups sampled, {c['zero_var_groups']} had zero variance): raise rl.max_attempts or "
                "rl.oversample_factor, set rl.partial_batches, or make the task easier/harder so "
                "rewards differ within a group"
            )
        self.attempts += 1
        return self.attempts

    def add(self, groups: Iterable[Group]) -> list[GroupDecision]:
        """Filter scored groups into the buffer; returns what happened to each (for `groups`)."""
        decisions = []
        for g in groups:
            stats = g.stats(ZERO_VARIANCE_EPS)
            self._count("sampled_groups")
            if stats.zero_variance and self.options.drop_zero_variance:
                self._count("zero_var_groups")
                decisions.append(GroupDecision(g, stats, "zero_variance", f"group reward std {stats.std:.3g} <= "
                                               f"eps {ZERO_VARIANCE_EPS:g} (all {stats.n} rewards equal)"))
            else:
                self._count("valid_groups")
                decisions += self._insert(g, stats)
        return decisions

    def _insert(self, group: Group, stats: GroupStats) -> list[GroupDecision]:
        """Keep only the latest policy version of each example: `group` is 'valid', or 'stale'
        when a newer one waits; older waiting groups it replaces are evicted as 'stale'."""
        same = [p for p in self.pending if (p.env, p.example_id) == (group.env, group.example_id)]
        newer = [p for p in same if p.policy_version > group.policy_version]
        if newer:
            self._count("stale_dropped")
            return [GroupDecision(group, stats, "stale", f"group {newer[0].group_id} of the same example from "
                                  f"newer policy version {newer[0].policy_version} is waiting")]
        older = [p for p in same if p.policy_version < group.policy_version]
        if older:
            self._count("stale_dropped", len(older))
            self.pending = [p for p in self.pending if all(p is not o for o in older)]
        self.pending.append(group)
        return [GroupDecision(p, p.stats(ZERO_VARIANCE_EPS), "stale", f"replaced by group {group.group_id} of the "
                              f"same example from newer policy version {group.policy_version}") for p in older
                ] + [GroupDecision(group, stats, "valid")]

    def fill(self, policy_version: int, sample_round: Callable[[int, int], Sequence[Group]]
             ) -> list[GroupDecision]:
        """Run sampling rounds until the batch is full: `sample_round(attempt, n_prompts)` returns
        a round's scored groups. Carried groups count first. With `partial_batches`, stops after
        max_attempts rounds instead of raising BatchFillError."""
        decisions = self.start_batch(policy_version)
        while self.need() > 0:
            if self.options.partial_batches and self.attempts >= self.options.max_attempts:
                break  # train on what the rounds found
            try:
                attempt = self.begin_attempt()
            except BatchFillError as error:
                error.decisions = decisions  # the fate of what the failed rounds sampled
                raise
            decisions += self.add(sample_round(attempt, self.prompts_to_sample()))
        return decisions

    def take(self) -> tuple[list[Group], dict[str, float]]:
        """The batch's groups (oldest first, up to prompts_per_step) and its metrics; the surplus
        stays for the next step."""
        n = self.options.prompts_per_step
        batch, self.pending = self.pending[:n], self.pending[n:]
        c = self.batch_counts
        metrics = {
            m.ZERO_VAR_GROUPS: float(c["zero_var_groups"]),
            m.VALID_GROUPS: float(c["valid_groups"]),
            m.SAMPLED_GROUPS: float(c["sampled_groups"]),
            m.STALE_DROPPED: float(c["stale_dropped"]),
            m.ZERO_VAR_FRACTION: c["zero_var_groups"] / c["sampled_groups"] if c["sampled_groups"] else 0.0,
            m.ATTEMPTS: float(self.attempts),
            m.CARRIED_GROUPS: float(len(self.pending)),
            m.BATCH_GROUPS: float(len(batch)),
        }
        return batch, metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: pending groups, policy version, counters (the config excluded)."""
        return {
            "pending": [g.to_dict() for g in self.pending],
            "policy_version": self.policy_version,
            "attempts": self.attempts,
            "batch_counts": dict(self.batch_counts),
            "total_counts": dict(self.total_counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending = [Group.from_dict(d) for d in state["pending"]]
        self.policy_version = int(state["policy_version"])
        self.attempts = int(state["attempts"])
        self.batch_counts = {k: int(state["batch_counts"].get(k, 0)) for k in _COUNTERS}
        self.total_counts = {k: int(state["total_counts"].get(k, 0)) for k in _COUNTERS}
