"""Advantages of the GRPO family and the zero-variance test; the over-sampling buffer that
fills a batch from scored groups is rollouts/group_buffer.py.

A group is the completions of one prompt under one policy version, keyed by
(env, example_id, policy_version). Its advantages come from a named estimator:

    grpo   A_i = r_i − mean(r)                 (÷ (std(r) + eps) with normalize_std)
    rloo   A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean(r))   (a group of 1 gets 0)

`positive_only` clamps A at 0 (learn from successes only). std is the population standard
deviation (ddof=0). A group whose std ≤ eps carries no signal (every advantage is 0) and is dropped
and counted as zero-variance.

Everything here is plain Python (no torch): pure functions over lists of floats and small records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rlpipe.rollouts.distill import DistillOptions

ESTIMATORS = ("grpo", "rloo")
ZERO_VARIANCE_EPS = 1e-6
"""A group whose reward std is at most this carries no signal; also the std normaliser's epsilon."""


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


def overlong_penalty(length: int, max_length: int, buffer_length: int, factor: float = 1.0) -> float:
    """DAPO soft overlong penalty, added to the reward: 0 up to max_length − buffer_length, then a
    linear ramp down to −factor at max_length, and −factor beyond (Yu et al. 2025, arXiv
    2503.14476, eq. 13; verl's `overlong_buffer.penalty_factor`)."""
    if not 0 <= buffer_length <= max_length:
        raise ValueError(
            f"need 0 <= buffer_length <= max_length, got {buffer_length}, {max_length}"
        )
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length > max_length:
        return -factor
    return factor * (start - length) / buffer_length


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


@dataclass(frozen=True)
class AdvantageOptions:
    """The estimator and its switches, as the `[rl]` section names them (its defaults are there)."""

    estimator: str
    normalize_std: bool
    positive_only: bool
    distill: DistillOptions = DistillOptions()
    """On-policy distillation ([rl.distill]): the teacher's per-token term (rollouts/distill.py)."""


def group_advantages(groups: Iterable[Group], options: AdvantageOptions) -> dict[str, float]:
    """sample_id → advantage for every completion of `groups`."""
    out: dict[str, float] = {}
    for g in groups:
        adv = compute_advantages(
            g.rewards, options.estimator, options.normalize_std, ZERO_VARIANCE_EPS, options.positive_only
        )
        out.update(zip(g.sample_ids, adv, strict=True))
    return out


def group_row(group: Group, eps: float = ZERO_VARIANCE_EPS) -> dict[str, Any]:
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
