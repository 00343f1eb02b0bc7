"""Batch makers: which valid groups a step trains on, and which the buffer keeps for later.

A batch maker is purely in memory. The group buffer (rollouts/group_buffer.py `GroupBuffer`)
does everything around it: it runs the sampling rounds, drops zero-variance groups, counts,
records every decision in the `decisions`/`groups` tables (through rollouts/fates.py) and puts
the maker's state into the checkpoint's data_state. The maker only answers five calls:

    maker.add(groups)            # valid groups of a sampling round -> their GroupDecisions (or None: all kept)
    maker.create_batch(size)     # exactly `size` groups, taken out of the maker, or None: not enough yet
    maker.metadata(batch)        # {name: number} about a batch it made: rollout/batch_<name> metrics
    maker.state_dict()           # plain JSON, enough to make the same batches after a resume
    maker.load_state_dict(state)

and, optionally, `start_batch(policy_version)` (called before each step's batch, returning the
decisions of groups it evicts for age). A maker that drops a group it was given returns a
`GroupDecision` with status 'stale' and the reason, so the group's fate is recorded.

The built-in `GrpoBatchMaker` offers retention ("latest": only the newest policy version of
each example, "all": every version, "max_age": every version up to rl.buffer.max_age versions
old) and sampling ("oldest": oldest first, "reservoir": a bounded reservoir of valid groups,
each batch drawn from it at random with the run's seed, its random state in state_dict so a
resumed run draws the same batches). `rl.buffer.batch_maker = "module:Class"` replaces it with a
user's class, constructed as `Class(options)` with this module's `BatchMakerOptions`.

Plain Python (no torch), like rollouts/advantages.py whose `Group` records it holds.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rlpipe.core.user_code import import_user_object
from rlpipe.rollouts.advantages import ZERO_VARIANCE_EPS, Group, GroupStats

RETENTIONS = ("latest", "all", "max_age")


class BatchMakerError(ValueError):
    """A batch maker raised, or broke its contract (a group it was not given, one already trained,
    changed or given twice, a value that is not a group): one line naming the maker."""
SAMPLINGS = ("oldest", "reservoir")


@dataclass
class GroupDecision:
    """What the buffer did with one group: status is 'valid', 'zero_variance' or 'stale'
    (dropped by the retention: too old, replaced by a newer group of its example, or evicted
    from a full reservoir; `kept` in the groups table says whether a valid group was trained),
    and `reason`, the human text of a drop (the `fates` view, rollouts/fates.py)."""

    group: Group
    stats: GroupStats
    status: str
    reason: str = ""


def stale(group: Group, reason: str) -> GroupDecision:
    """The decision of a group a batch maker drops, with its reason."""
    return GroupDecision(group, group.stats(ZERO_VARIANCE_EPS), "stale", reason)


def valid(group: Group) -> GroupDecision:
    """The decision of a group a batch maker keeps."""
    return GroupDecision(group, group.stats(ZERO_VARIANCE_EPS), "valid")


@dataclass(frozen=True)
class BatchMakerOptions:
    """What a batch maker reads of the config: `[rl.buffer]`, the run's seed and the age bound
    (their meaning and defaults are in training/config.py)."""

    retention: str = "latest"
    max_age: int = 1
    sampling: str = "oldest"
    reservoir_size: int = 64
    seed: int = 0
    staleness_limit: int = 1
    """Most policy versions a group held with retention "latest" or "all" may lag the version
    being trained (rollouts/group_buffer.py `staleness_limit`)."""
    spec: str = ""
    """rl.buffer.batch_maker: a user's "module:Class", or "" for `GrpoBatchMaker`."""

    @property
    def age_limit(self) -> int:
        """The age bound of held groups: max_age with retention "max_age", else staleness_limit."""
        return self.max_age if self.retention == "max_age" else self.staleness_limit


@runtime_checkable
class BatchMaker(Protocol):
    """Makes the batches of valid groups a step trains on (see the module docstring)."""

    def add(self, groups: Sequence[Group]) -> Sequence[GroupDecision] | None:
        """Take a round's valid groups; the decisions of those kept ('valid') and dropped
        ('stale', with a reason), or None when every one is kept."""

    def create_batch(self, size: int) -> list[Group] | None:
        """`size` groups removed from the maker, or None when it cannot make that many yet."""

    def metadata(self, batch: Sequence[Group]) -> Mapping[str, float]:
        """Numbers about a batch it made, logged as rollout/batch_<name>."""

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: everything the next batches depend on."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class GrpoBatchMaker:
    """The built-in batch maker: retention and sampling as `[rl.buffer]` sets them."""

    def __init__(self, options: BatchMakerOptions) -> None:
        self.options = options
        self.groups: list[Group] = []
        self.rng = random.Random(options.seed)

    def start_batch(self, policy_version: int) -> list[GroupDecision]:
        """Evict held groups older than the age bound before the batch that trains `policy_version`."""
        limit = self.options.age_limit
        old = [g for g in self.groups if policy_version - g.policy_version > limit]
        self.groups = [g for g in self.groups if policy_version - g.policy_version <= limit]
        bound = f"rl.buffer.max_age {limit}" if self.options.retention == "max_age" else f"the staleness limit {limit}"
        return [stale(g, f"policy version {g.policy_version} lags training version {policy_version} by more "
                         f"than {bound}") for g in old]

    def add(self, groups: Sequence[Group]) -> list[GroupDecision]:
        """Hold each group under the retention (and the reservoir's size); their decisions."""
        decisions: list[GroupDecision] = []
        for group in groups:
            decisions += self._retain(group) if self.options.retention == "latest" else [self._hold(group)]
            if self.options.sampling == "reservoir" and len(self.groups) > self.options.reservoir_size:
                out = self.groups.pop(self.rng.randrange(len(self.groups) - 1))  # never the newcomer
                decisions.append(stale(out, f"evicted at random from the full reservoir (rl.buffer.reservoir_size="
                                            f"{self.options.reservoir_size}) for group {group.group_id}"))
        return decisions

    def _hold(self, group: Group) -> GroupDecision:
        self.groups.append(group)
        return valid(group)

    def _retain(self, group: Group) -> list[GroupDecision]:
        """Only the latest policy version of each example: `group` is 'valid', or 'stale' when a
        newer one waits; older waiting groups it replaces are evicted as 'stale'."""
        same = [p for p in self.groups if (p.env, p.example_id) == (group.env, group.example_id)]
        newer = [p for p in same if p.policy_version > group.policy_version]
        if newer:
            return [stale(group, f"group {newer[0].group_id} of the same example from newer policy version "
                                 f"{newer[0].policy_version} is waiting")]
        older = [p for p in same if p.policy_version < group.policy_version]
        self.groups = [p for p in self.groups if all(p is not o for o in older)]
        return [stale(p, f"replaced by group {group.group_id} of the same example from newer policy version "
                         f"{group.policy_version}") for p in older] + [self._hold(group)]

    def create_batch(self, size: int) -> list[Group] | None:
        """`size` groups: the oldest held, or drawn at random from the reservoir; None when fewer are held."""
        if len(self.groups) < size:
            return None
        if self.options.sampling == "oldest":
            batch, self.groups = self.groups[:size], self.groups[size:]
            return batch
        picked = self.rng.sample(range(len(self.groups)), size)
        batch = [self.groups[i] for i in picked]
        chosen = set(picked)
        self.groups = [g for i, g in enumerate(self.groups) if i not in chosen]
        return batch

    def metadata(self, batch: Sequence[Group]) -> dict[str, float]:
        """The policy versions the batch came from and the groups still held after it."""
        versions = [g.policy_version for g in batch]
        return {"oldest_version": float(min(versions, default=0)), "newest_version": float(max(versions, default=0)),
                "held_groups": float(len(self.groups))}

    def state_dict(self) -> dict[str, Any]:
        """The held groups in order and, for the reservoir, the random generator's state."""
        state: dict[str, Any] = {"groups": [g.to_dict() for g in self.groups]}
        if self.options.sampling == "reservoir":
            version, internal, gauss = self.rng.getstate()
            state["rng"] = [version, list(internal), gauss]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s groups and random state."""
        self.groups = [Group.from_dict(d) for d in state["groups"]]
        if "rng" in state:
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))


def batch_maker_class(spec: str) -> type:
    """The class a "module:Class" rl.buffer.batch_maker names; ValueError in one line naming it otherwise."""
    cls = import_user_object(spec, "rl.buffer.batch_maker")
    missing = [name for name in ("add", "create_batch", "metadata", "state_dict", "load_state_dict")
               if not callable(getattr(cls, name, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"rl.buffer.batch_maker {spec!r} must name a class with add, create_batch, metadata, state_dict "
                         f"and load_state_dict{' (missing: ' + ', '.join(missing) + ')' if missing else ''}")
    return cls


def build_batch_maker(options: BatchMakerOptions) -> BatchMaker:
    """The user's batch maker when `options.spec` names one, else the built-in GrpoBatchMaker."""
    if options.spec:
        return batch_maker_class(options.spec)(options)
    return GrpoBatchMaker(options)
