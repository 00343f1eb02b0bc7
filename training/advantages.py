"""Advantages of the GRPO family, the zero-variance filter, and the over-sampling group buffer.

A group is the completions of one prompt under one policy version, keyed by
(env, example_id, policy_version). Its advantages come from a named estimator:

    grpo   A_i = r_i − mean(r)                 (÷ (std(r) + eps) with normalize_std)
    rloo   A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean(r))   (a group of 1 gets 0)

`positive_only` clamps A at 0 (learn from successes only). std is the population standard
deviation (ddof=0). A group whose std ≤ eps carries no signal (every advantage is 0) and is dropped
and counted as zero-variance.

Over-sampling: the rollout manager samples `oversample_factor ×` the prompts still needed, scores
them, and hands the groups to a `GroupBuffer`. The buffer drops zero-variance (and user-filtered)
groups, keeps the valid ones, gives `groups_per_batch` of them to the step and carries the surplus
to the next step — dropping carried groups more than `max_staleness` policy versions old, and keeping
only the latest policy version per example. After `max_attempts` sampling rounds without a full
batch it raises `BatchFillError`. Its state is plain JSON (checkpoint data_state.json).

    buffer = GroupBuffer(BufferConfig(groups_per_batch=16, oversample_factor=1.5))
    groups, metrics = fill_batch(buffer, policy_version, sample_groups)

Everything here is plain Python (no torch): pure functions over lists of floats and small records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ESTIMATORS = ("grpo", "rloo")
SELECTIONS = ("fifo", "max_std")


class BatchFillError(RuntimeError):
    """The buffer could not collect enough valid groups within max_attempts sampling rounds."""


# ---------------------------------------------------------------------------- estimators


@dataclass(frozen=True)
class GroupStats:
    """n, mean, std (population) of a group's rewards; zero_variance = std <= eps."""

    n: int
    mean: float
    std: float
    zero_variance: bool


def group_stats(rewards: Sequence[float], eps: float = 1e-6) -> GroupStats:
    """Statistics of one group's rewards (ValueError on an empty group)."""
    n = len(rewards)
    if n == 0:
        raise ValueError("group_stats: empty group")
    mean = math.fsum(rewards) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
    return GroupStats(n=n, mean=mean, std=std, zero_variance=std <= eps)


def compute_advantages(
    rewards: Sequence[float],
    estimator: str = "grpo",
    normalize_std: bool = False,
    eps: float = 1e-6,
    positive_only: bool = False,
) -> list[float]:
    """Advantages of one group's completions, in order (see module docstring)."""
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS)}"
        )
    stats = group_stats(rewards, eps)
    n = stats.n
    if estimator == "grpo":
        adv = [r - stats.mean for r in rewards]
    elif n == 1:  # rloo: no other sample to form a baseline from
        adv = [0.0]
    else:
        adv = [n / (n - 1) * (r - stats.mean) for r in rewards]
    if normalize_std:
        adv = [a / (stats.std + eps) for a in adv]
    if positive_only:
        adv = [max(a, 0.0) for a in adv]
    return adv


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How advantages are computed from a group's rewards."""

    estimator: Literal["grpo", "rloo"] = "grpo"
    """Advantage estimator."""
    normalize_std: bool = False
    """Divide by the group's reward std (+ eps)."""
    positive_only: bool = False
    """Clamp advantages at 0."""
    eps: float = 1e-6
    """std <= eps counts as zero variance; also the std normaliser's epsilon."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"unknown advantage estimator {self.estimator!r}; known: {', '.join(ESTIMATORS)}"
            )
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


def overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO soft overlong penalty, added to the reward: 0 up to max_length − buffer_length, then a
    linear ramp down to −1 at max_length, and −1 beyond."""
    if not 0 <= buffer_length <= max_length:
        raise ValueError(
            f"need 0 <= buffer_length <= max_length, got {buffer_length}, {max_length}"
        )
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length > max_length:
        return -1.0
    return (start - length) / buffer_length


# ---------------------------------------------------------------------------- groups


@dataclass
class Group:
    """The scored completions of one prompt under one policy version.

    group_id:       id of the group (rollouts.group_id)
    env, example_id: the prompt
    policy_version: weights that sampled it
    sample_ids:     rollout rows, in order
    rewards:        their rewards, same order
    attempt:        sampling round of its step that produced it (1-based)
    """

    group_id: str
    env: str
    example_id: str
    policy_version: int
    sample_ids: list[str]
    rewards: list[float]
    attempt: int = 1

    def __post_init__(self) -> None:
        if len(self.sample_ids) != len(self.rewards):
            raise ValueError(
                f"group {self.group_id!r}: {len(self.sample_ids)} sample_ids for {len(self.rewards)} rewards"
            )
        if not self.sample_ids:
            raise ValueError(f"group {self.group_id!r} is empty")

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.env, self.example_id, self.policy_version)

    def stats(self, eps: float = 1e-6) -> GroupStats:
        return group_stats(self.rewards, eps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        return cls(
            group_id=str(d["group_id"]),
            env=str(d["env"]),
            example_id=str(d["example_id"]),
            policy_version=int(d["policy_version"]),
            sample_ids=[str(s) for s in d["sample_ids"]],
            rewards=[float(r) for r in d["rewards"]],
            attempt=int(d.get("attempt", 1)),
        )


def make_groups(rows: Iterable[Mapping[str, Any]], attempt: int = 1) -> list[Group]:
    """Group scored rollout rows by (env, example_id, policy_version), in first-seen order.

    Each row needs group_id, env, example_id, policy_version, sample_id, reward. Rows sharing a key
    form one group (more samples of the same prompt under the same weights), named by the first
    row's group_id.
    """
    groups: dict[tuple[str, str, int], Group] = {}
    for row in rows:
        key = (str(row["env"]), str(row["example_id"]), int(row["policy_version"]))
        if key not in groups:
            groups[key] = Group(
                group_id=str(row["group_id"]),
                env=key[0],
                example_id=key[1],
                policy_version=key[2],
                sample_ids=[str(row["sample_id"])],
                rewards=[float(row["reward"])],
                attempt=attempt,
            )
        else:
            groups[key].sample_ids.append(str(row["sample_id"]))
            groups[key].rewards.append(float(row["reward"]))
    return list(groups.values())


def group_advantages(groups: Iterable[Group], config: AdvantageConfig) -> dict[str, float]:
    """sample_id → advantage for every completion of `groups`."""
    out: dict[str, float] = {}
    for g in groups:
        adv = compute_advantages(
            g.rewards, config.estimator, config.normalize_std, config.eps, config.positive_only
        )
        out.update(zip(g.sample_ids, adv, strict=True))
    return out


def group_row(group: Group, eps: float = 1e-6) -> dict[str, Any]:
    """The statistics columns of a `groups` table row for `group`."""
    s = group.stats(eps)
    return {
        "group_id": group.group_id,
        "env": group.env,
        "example_id": group.example_id,
        "policy_version": group.policy_version,
        "n": s.n,
        "reward_mean": s.mean,
        "reward_std": s.std,
        "zero_variance": s.zero_variance,
        "attempts": group.attempt,
    }


# ---------------------------------------------------------------------------- over-sampling buffer


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
