"""The over-sampling group buffer: fills each step's batch with groups that carry signal.

Over-sampling: the rollout manager samples `oversample_factor ×` the prompts still needed, scores
them, and hands the groups to a `GroupBuffer`. The buffer drops zero-variance (and user-filtered)
groups, keeps the valid ones, gives `groups_per_batch` of them to the step and carries the surplus
to the next step — dropping carried groups more than `max_staleness` policy versions old, and keeping
only the latest policy version per example. After `max_attempts` sampling rounds without a full
batch it raises `BatchFillError`. Its state is plain JSON (checkpoint data_state.json).

    buffer = GroupBuffer(BufferConfig(groups_per_batch=16, oversample_factor=1.5))
    groups, metrics = fill_batch(buffer, policy_version, sample_groups)

Plain Python (no torch), like training/advantages.py whose `Group` records it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from training.advantages import Group, GroupStats

SELECTIONS = ("fifo", "max_std")


class BatchFillError(RuntimeError):
    """The buffer could not collect enough valid groups within max_attempts sampling rounds."""


@dataclass(frozen=True, kw_only=True)
class BufferConfig:
    """How the rollout manager fills a batch of groups."""

    groups_per_batch: int
    """Valid groups (prompts) trained on per step."""
    oversample_factor: float = 1.0
    """Sample this many times the prompts still needed in each round."""
    max_attempts: int = 4
    """Sampling rounds per batch before BatchFillError."""
    max_staleness: int | None = 1
    """Carried groups more than this many versions behind the current policy are dropped
    (0 = no carry-over; None = never dropped for age)."""
    latest_only: bool = True
    """Keep only the latest policy version of each (env, example_id)."""
    selection: Literal["fifo", "max_std"] = "fifo"
    """Which valid groups a batch takes: oldest first, or largest reward std first."""
    max_carry: int | None = None
    """Most surplus groups carried to the next step (None = all)."""
    drop_zero_variance: bool = True
    """Drop groups whose reward std <= eps."""
    eps: float = 1e-6
    """Zero-variance threshold."""

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.oversample_factor < 1.0:
            raise ValueError(f"oversample_factor must be >= 1, got {self.oversample_factor}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"unknown selection {self.selection!r}; known: {', '.join(SELECTIONS)}"
            )
        if self.max_carry is not None and self.max_carry < 0:
            raise ValueError(f"max_carry must be >= 0 or None, got {self.max_carry}")


_COUNTERS = (
    "sampled_groups",
    "zero_var_groups",
    "filtered_groups",
    "valid_groups",
    "stale_dropped",
)


@dataclass
class GroupDecision:
    """What the buffer did with one added group: status is 'valid', 'zero_variance' or 'filtered'."""

    group: Group
    stats: GroupStats
    status: str


@dataclass
class GroupBuffer:
    """Valid groups waiting to be trained on, with the counters of the batch being filled.

    group_filter: optional user predicate; groups it rejects are dropped and counted (not saved
    in state_dict: pass it again when restoring).
    """

    config: BufferConfig
    group_filter: Callable[[Group], bool] | None = None
    pending: list[Group] = field(default_factory=list)
    policy_version: int = 0
    attempts: int = 0
    batch_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    total_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))

    def _count(self, name: str, n: int = 1) -> None:
        self.batch_counts[name] += n
        self.total_counts[name] += n

    def start_batch(self, policy_version: int) -> None:
        """Begin filling the batch for `policy_version`: evict stale carried groups, reset counters."""
        self.policy_version = policy_version
        self.attempts = 0
        self.batch_counts = dict.fromkeys(_COUNTERS, 0)
        limit = self.config.max_staleness
        if limit is not None:
            fresh = [g for g in self.pending if policy_version - g.policy_version <= limit]
            self._count("stale_dropped", len(self.pending) - len(fresh))
            self.pending = fresh

    def need(self) -> int:
        """Valid groups still missing for a full batch."""
        return max(0, self.config.groups_per_batch - len(self.pending))

    def prompts_to_sample(self) -> int:
        """Prompts to sample in the next round: ceil(need × oversample_factor)."""
        return math.ceil(self.need() * self.config.oversample_factor)

    def begin_attempt(self) -> int:
        """Count a sampling round (1-based number); BatchFillError once max_attempts are used up."""
        if self.attempts >= self.config.max_attempts:
            c = self.batch_counts
            raise BatchFillError(
                f"could not fill {self.config.groups_per_batch} groups with non-zero reward variance "
                f"after {self.attempts} attempts ({len(self.pending)} valid; of {c['sampled_groups']} "
                f"groups sampled, {c['zero_var_groups']} had zero variance and "
                f"{c['filtered_groups']} were filtered out): raise max_attempts or "
                "oversample_factor, or make the task easier/harder so rewards differ within a group"
            )
        self.attempts += 1
        return self.attempts

    def add(self, groups: Iterable[Group]) -> list[GroupDecision]:
        """Filter scored groups into the buffer; returns what happened to each (for `groups`)."""
        decisions = []
        for g in groups:
            stats = g.stats(self.config.eps)
            self._count("sampled_groups")
            if stats.zero_variance and self.config.drop_zero_variance:
                self._count("zero_var_groups")
                status = "zero_variance"
            elif self.group_filter is not None and not self.group_filter(g):
                self._count("filtered_groups")
                status = "filtered"
            else:
                self._count("valid_groups")
                self._insert(g)
                status = "valid"
            decisions.append(GroupDecision(group=g, stats=stats, status=status))
        return decisions

    def _insert(self, group: Group) -> None:
        if self.config.latest_only:
            same = [
                p for p in self.pending if (p.env, p.example_id) == (group.env, group.example_id)
            ]
            if any(p.policy_version > group.policy_version for p in same):
                self._count("stale_dropped")
                return
            older = {id(p) for p in same if p.policy_version < group.policy_version}
            if older:
                self._count("stale_dropped", len(older))
                self.pending = [p for p in self.pending if id(p) not in older]
        self.pending.append(group)

    def take(self) -> tuple[list[Group], dict[str, float]]:
        """The batch's groups (up to groups_per_batch) and its metrics; the surplus stays."""
        n = self.config.groups_per_batch
        if self.config.selection == "max_std":
            order = sorted(
                range(len(self.pending)), key=lambda i: -self.pending[i].stats(self.config.eps).std
            )
        else:
            order = list(range(len(self.pending)))
        chosen = set(order[:n])
        batch = [self.pending[i] for i in order[:n]]
        surplus = [g for i, g in enumerate(self.pending) if i not in chosen]
        if self.config.max_carry is not None and len(surplus) > self.config.max_carry:
            surplus = surplus[len(surplus) - self.config.max_carry :]  # keep the newest
        self.pending = surplus
        c = self.batch_counts
        metrics = {
            "rollout/zero_var_groups": float(c["zero_var_groups"]),
            "rollout/filtered_groups": float(c["filtered_groups"]),
            "rollout/valid_groups": float(c["valid_groups"]),
            "rollout/sampled_groups": float(c["sampled_groups"]),
            "rollout/stale_dropped": float(c["stale_dropped"]),
            "rollout/zero_var_fraction": c["zero_var_groups"] / c["sampled_groups"]
            if c["sampled_groups"]
            else 0.0,
            "rollout/attempts_per_batch": float(self.attempts),
            "rollout/carried_groups": float(len(self.pending)),
            "rollout/batch_groups": float(len(batch)),
        }
        return batch, metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: pending groups, policy version, counters (config and filter excluded)."""
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


def fill_batch(
    buffer: GroupBuffer,
    policy_version: int,
    sample_groups: Callable[[int, int], Sequence[Group]],
) -> tuple[list[Group], dict[str, float]]:
    """Fill one batch: `sample_groups(attempt, n_prompts)` returns scored groups for a round.

    Carried groups count first; rounds continue until the batch is full, and BatchFillError is
    raised when max_attempts rounds were not enough.
    """
    buffer.start_batch(policy_version)
    while buffer.need() > 0:
        attempt = buffer.begin_attempt()
        buffer.add(sample_groups(attempt, buffer.prompts_to_sample()))
    return buffer.take()
