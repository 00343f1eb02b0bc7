"""The over-sampling group buffer: fills each step's batch with groups that carry signal.

Over-sampling: a sampling round asks for `oversample_factor ×` the groups still needed (scaled up
by the share of sampled groups that turned out valid), and the buffer drops zero-variance groups
and hands the valid ones to its batch maker (rollouts/batch_makers.py), which keeps them under
its retention, makes the step's batch of `prompts_per_step` groups and carries the surplus to the
next step. The built-in maker's defaults: carried groups more than `staleness_limit` policy
versions behind the step being trained are dropped as stale, only the latest policy version of
each example is kept, batches are taken oldest first. After `max_attempts` rounds without a full
batch, `fill` raises `BatchFillError` (or, with `partial_batches`, returns what it found). Its
state, the maker's included, is plain JSON (checkpoint data_state.json).

The buffer does not trust a maker (a user's, rl.buffer.batch_maker) with the training contract.
It keeps its own copy of every group it hands the maker, and a group the maker puts in a batch
is trained only when it is one the buffer gave it and has not trained or dropped, unchanged (its
digest of ids, versions and rewards equal to the copy's), and given once; the copy is what is
trained. Anything else is refused: a value that is not a group, a decision about a group it was
not given, or a maker that raises fails the step in one line naming the maker
(`BatchMakerError`); a maker whose batches hold no usable group for `MAKER_STRIKES` calls in a
row fails the step the same way, so no maker can make the buffer ask forever. Each sampling and
batch round checks for SIGTERM (core/termination.py).

    buffer = GroupBuffer(options)                   # BufferOptions (rollouts/options.py builds them)
    decisions = buffer.fill(version, sample_round)  # sample_round(attempt, n_prompts) -> groups
    batch, metrics = buffer.take()

Plain Python (no torch), like rollouts/advantages.py whose `Group` records it holds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpipe.core import metric_names as m
from rlpipe.core.termination import raise_if_terminated
from rlpipe.rollouts.advantages import ZERO_VARIANCE_EPS, Group
from rlpipe.rollouts.batch_makers import (
    BatchMaker,
    BatchMakerError,
    BatchMakerOptions,
    GroupDecision,
    build_batch_maker,
    stale,
    valid,
)
from rlpipe.rollouts.maker_checks import _copy, _describe, group_digest

__all__ = ["BatchFillError", "BatchMakerError", "BufferOptions", "GroupBuffer", "GroupDecision",
           "staleness_limit"]

MAKER_STRIKES = 3
"""create_batch calls in a row that give no usable group before the step fails, naming the maker."""


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
    maker: BatchMakerOptions = BatchMakerOptions()
    """The batch maker's options (`[rl.buffer]`, rl.buffer.batch_maker, the seed)."""


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
class GroupBuffer:
    """Valid groups waiting to be trained on, held by the batch maker, with the counters of the
    batch being filled. The buffer keeps its own list of the groups the maker holds (`pending`:
    those it kept and has not yet dropped or put in a batch) for the fates of carried groups."""

    options: BufferOptions
    maker: BatchMaker = field(default=None)  # type: ignore[assignment]  # built from options.maker
    held: dict[str, Group] = field(default_factory=dict)
    policy_version: int = 0
    attempts: int = 0
    batch: list[Group] | None = None
    batch_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    total_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    strikes: int = 0
    """create_batch calls in a row that gave no usable group (MAKER_STRIKES fails the step)."""

    def __post_init__(self) -> None:
        if self.maker is None:
            self.maker = self._ask("its constructor", build_batch_maker, self.options.maker)

    @property
    def maker_name(self) -> str:
        """How errors name the maker: rl.buffer.batch_maker's "module:Class", else its class."""
        return self.options.maker.spec or type(self.maker).__name__

    def _ask(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the maker; an exception it raises becomes one line naming it (BatchMakerError)."""
        try:
            return fn(*args)
        except BatchMakerError:
            raise
        except Exception as error:  # noqa: BLE001 - a user's code: named, with its first line
            detail = (str(error).strip().splitlines() or [""])[0]
            name = self.options.maker.spec or (type(self.maker).__name__ if self.maker is not None else "?")
            raise BatchMakerError(f"batch maker {name}: {call} raised {type(error).__name__}"
                                  f"{': ' + detail if detail else ''}") from error

    def _refuse(self, what: str) -> BatchMakerError:
        return BatchMakerError(f"batch maker {self.maker_name}: {what}")

    def _checked_decisions(self, answer: Any, call: str, given: Mapping[str, Group]) -> list[GroupDecision]:
        """A maker's decisions, each about a group it was `given` now (kept or dropped) or one it
        holds (dropped), unchanged, and none after the group's drop; rebuilt on the buffer's own
        copies."""
        if answer is None:
            return []
        if isinstance(answer, (str, bytes, Mapping)) or not isinstance(answer, Iterable):
            raise self._refuse(f"{call} returned {_describe(answer)}; it returns GroupDecisions or None")
        out, dropped = [], set()
        for d in answer:
            if not isinstance(d, GroupDecision) or not isinstance(d.group, Group):
                raise self._refuse(f"{call} returned {_describe(d)} among its decisions; it returns "
                                   "GroupDecisions (batch_makers.valid(g) / stale(g, reason)) or None")
            gid = d.group.group_id
            ours = given.get(gid) if gid in given else self.held.get(gid)
            problem = ("it was not given" if ours is None else "decided again after it was dropped" if gid in dropped
                       else "changed" if group_digest(d.group) != group_digest(ours)
                       else f"status {d.status!r} (valid or stale)" if d.status not in ("valid", "stale")
                       else "kept, though it was given in an earlier round" if d.status == "valid" and gid not in given
                       else None)
            if problem is not None:
                raise self._refuse(f"{call} returned a decision about group {gid!r}: {problem}")
            if d.status == "stale":
                dropped.add(gid)
            out.append(GroupDecision(ours, ours.stats(ZERO_VARIANCE_EPS), d.status, str(d.reason)))
        return out

    @property
    def pending(self) -> list[Group]:
        """The valid groups waiting in the batch maker (carried to a later step)."""
        return list(self.held.values())

    def _count(self, name: str, n: int = 1) -> None:
        self.batch_counts[name] += n
        self.total_counts[name] += n

    def _record(self, decisions: Sequence[GroupDecision]) -> list[GroupDecision]:
        """Follow the maker's decisions: a kept group is held, a dropped one ('stale') no longer."""
        for d in decisions:
            if d.status == "valid":
                self.held[d.group.group_id] = d.group
            else:
                self.held.pop(d.group.group_id, None)
                self._count("stale_dropped")
        return list(decisions)

    def start_batch(self, policy_version: int) -> list[GroupDecision]:
        """Begin filling the batch that trains `policy_version`: reset counters, let the maker
        evict held groups for age (returned as decisions)."""
        self.policy_version = policy_version
        self.attempts = 0
        self.batch = None
        self.batch_counts = dict.fromkeys(_COUNTERS, 0)
        evict = getattr(self.maker, "start_batch", None)
        if evict is None:
            return []
        answer = self._ask(f"start_batch({policy_version})", evict, policy_version)
        return self._record(self._checked_decisions(answer, f"start_batch({policy_version})", {}))

    def need(self) -> int:
        """Valid groups still missing for a full batch."""
        return max(0, self.options.prompts_per_step - len(self.batch or []) - len(self.held))

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
                f"after {self.attempts} attempts ({len(self.held) + len(self.batch or [])} valid; of "
                f"{c['sampled_groups']} groups sampled, {c['zero_var_groups']} had zero variance): raise "
                "rl.buffer.max_attempts or rl.buffer.oversample_factor, set rl.buffer.partial_batches, or make the task easier/harder "
                "so rewards differ within a group"
            )
        self.attempts += 1
        return self.attempts

    def add(self, groups: Iterable[Group]) -> list[GroupDecision]:
        """Filter scored groups: zero-variance ones are dropped here, the valid ones go to the batch
        maker; returns what happened to each (for `groups`)."""
        decisions: list[GroupDecision] = []
        kept: list[Group] = []

        def flush() -> None:  # hand the valid groups met so far to the maker, in order
            if kept:
                given = {g.group_id: _copy(g) for g in kept}  # ours: the maker gets the round's objects
                answer = self._checked_decisions(self._ask("add", self.maker.add, list(kept)), "add", given)
                decided = {d.group.group_id for d in answer}  # a group it did not decide: kept
                decisions.extend(self._record(answer + [valid(g) for g in given.values() if g.group_id not in decided]))
                kept.clear()

        for g in groups:
            stats = g.stats(ZERO_VARIANCE_EPS)
            self._count("sampled_groups")
            if stats.zero_variance and self.options.drop_zero_variance:
                flush()
                self._count("zero_var_groups")
                decisions.append(GroupDecision(g, stats, "zero_variance", f"group reward std {stats.std:.3g} <= "
                                               f"eps {ZERO_VARIANCE_EPS:g} (all {stats.n} rewards equal)"))
            else:
                self._count("valid_groups")
                kept.append(g)
        flush()
        return decisions

    def _bound(self) -> int:
        """Most policy versions a trained group may lag: the maker's age bound, or the async bound
        when that is larger (the built-in maker keeps to it; a user's maker is held to it here)."""
        return max(self.options.maker.age_limit, self.options.max_off_policy_steps)

    def _collect(self, size: int) -> list[GroupDecision] | None:
        """Ask the maker for `size` more groups of the batch: None when it cannot make them, else
        the decisions of those it gave that lag more than the bound (dropped as stale). Only
        groups the buffer holds, unchanged, once, go in the batch (the buffer's copies); the rest
        are refused, and MAKER_STRIKES calls in a row with nothing usable fail the step."""
        raise_if_terminated()
        got = self._ask(f"create_batch({size})", self.maker.create_batch, size) if size > 0 else []
        if got is None:
            return None
        if isinstance(got, (str, bytes, Mapping, Group)) or not isinstance(got, Iterable):
            raise self._refuse(f"create_batch({size}) returned {_describe(got)}; it returns a list of the "
                               "Group objects add gave it, or None")
        got = list(got)
        if (odd := next((g for g in got if not isinstance(g, Group)), None)) is not None:
            raise self._refuse(f"create_batch({size}) returned {_describe(odd)} among its groups; it returns "
                               "the Group objects add gave it, or None")
        if len(got) != size:
            raise self._refuse(f"create_batch({size}) returned {len(got)} groups; it returns exactly {size}, "
                               "or None when it cannot make that many yet")
        usable, changed, refused = [], [], []
        for g in got:
            ours = self.held.get(g.group_id)
            if ours is None or any(u is ours for u in usable + changed):
                refused.append(f"group {g.group_id!r} is not one it holds (never given, already trained or "
                               "dropped, or given twice)")
            elif group_digest(g) != group_digest(ours):
                refused.append(f"group {g.group_id!r} was changed (its ids or rewards differ from what add gave it)")
                changed.append(ours)
            else:
                usable.append(ours)
        late = []
        for ours in changed:  # out of the maker, never trained: dropped, with the reason as its fate
            self.held.pop(ours.group_id, None)
            self._count("stale_dropped")
            late.append(stale(ours, f"batch maker {self.maker_name} returned it changed (its ids or rewards "
                                    "differ from the scored group): not trained"))
        self.strikes = 0 if usable else self.strikes + 1
        if self.strikes >= MAKER_STRIKES:
            raise self._refuse(f"{self.strikes} create_batch calls in a row gave no group it may train ({refused[0]}); "
                               "a batch holds groups add gave it, not yet trained, unchanged, each once")
        limit = self._bound()
        for g in usable:
            self.held.pop(g.group_id, None)
            if self.policy_version - g.policy_version > limit:
                self._count("stale_dropped")
                late.append(stale(g, f"policy version {g.policy_version} lags training version "
                                     f"{self.policy_version} by more than the staleness limit {limit}"))
            else:
                self.batch = (self.batch or []) + [g]
        return late

    def _missing(self) -> int:
        return self.options.prompts_per_step - len(self.batch or [])

    def _collect_partial(self) -> list[GroupDecision]:
        """The largest batch the maker can make from what it holds (rl.buffer.partial_batches)."""
        for size in range(min(self._missing(), len(self.held)), 0, -1):
            late = self._collect(size)
            if late is not None:
                return late
        return []

    def fill(self, policy_version: int, sample_round: Callable[[int, int], Sequence[Group]]
             ) -> list[GroupDecision]:
        """Run sampling rounds until the maker makes a full batch: `sample_round(attempt,
        n_prompts)` returns a round's scored groups. Carried groups count first. With
        `partial_batches`, stops after max_attempts rounds instead of raising BatchFillError."""
        decisions = self.start_batch(policy_version)
        self.batch = []
        self.strikes = 0
        while self._missing() > 0:
            raise_if_terminated()
            late = self._collect(self._missing())
            if late is not None:  # made (less any groups too old for the bound: then ask again)
                decisions += late
                continue
            if self.options.partial_batches and self.attempts >= self.options.max_attempts:
                decisions += self._collect_partial()  # train on what the rounds found
                break
            try:
                attempt = self.begin_attempt()
            except BatchFillError as error:
                error.decisions = decisions  # the fate of what the failed rounds sampled
                raise
            decisions += self.add(sample_round(attempt, self.prompts_to_sample()))
            raise_if_terminated()
        return decisions

    def take(self) -> tuple[list[Group], dict[str, float]]:
        """The batch's groups (as the maker made it, up to prompts_per_step: full when `fill` ran
        without partial batches) and its metrics; the surplus stays for the next step."""
        if self._missing() > 0 and self._collect(self._missing()) is None:
            self._collect_partial()
        batch, self.batch = self.batch or [], None
        c = self.batch_counts
        metrics = {
            m.ZERO_VAR_GROUPS: float(c["zero_var_groups"]),
            m.VALID_GROUPS: float(c["valid_groups"]),
            m.SAMPLED_GROUPS: float(c["sampled_groups"]),
            m.STALE_DROPPED: float(c["stale_dropped"]),
            m.ZERO_VAR_FRACTION: c["zero_var_groups"] / c["sampled_groups"] if c["sampled_groups"] else 0.0,
            m.ATTEMPTS: float(self.attempts),
            m.CARRIED_GROUPS: float(len(self.held)),
            m.BATCH_GROUPS: float(len(batch)),
        }
        metrics |= self._metadata(batch)
        return batch, metrics

    def _metadata(self, batch: list[Group]) -> dict[str, float]:
        """The maker's metadata of `batch` as rollout/batch_<name> metrics; TypeError naming a value
        that is not a number."""
        out = {}
        answer = self._ask("metadata", self.maker.metadata, batch) or {}
        if not isinstance(answer, Mapping):
            raise self._refuse(f"metadata returned {_describe(answer)}; it returns {{name: number}}")
        for name, value in answer.items():
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"batch maker {self.maker_name}: metadata {name!r} is {value!r}; its "
                                "values must be numbers (logged as rollout/batch_<name>)")
            out[m.batch(name)] = float(value)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: pending groups, the maker's state, policy version, counters (the config excluded)."""
        return {
            "pending": [g.to_dict() for g in self.held.values()],
            "maker": self._ask("state_dict", self.maker.state_dict),
            "policy_version": self.policy_version,
            "attempts": self.attempts,
            "batch_counts": dict(self.batch_counts),
            "total_counts": dict(self.total_counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` (a state without the maker's, written before batch makers, held
        its pending groups oldest first, which is the built-in maker's state)."""
        pending = [Group.from_dict(d) for d in state["pending"]]
        self.held = {g.group_id: g for g in pending}
        self._ask("load_state_dict", self.maker.load_state_dict, state.get("maker", {"groups": state["pending"]}))
        self.policy_version = int(state["policy_version"])
        self.attempts = int(state["attempts"])
        self.batch = None
        self.batch_counts = {k: int(state["batch_counts"].get(k, 0)) for k in _COUNTERS}
        self.total_counts = {k: int(state["total_counts"].get(k, 0)) for k in _COUNTERS}

