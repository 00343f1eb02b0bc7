"""Batch makers: the built-in's retention and sampling, the reservoir's seeded draws and their
exact resumption, a user's batch maker loaded from "module:Class", and the config's checks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from rlpipe.core.config import ConfigError
from rlpipe.rollouts.advantages import Group
from rlpipe.rollouts.batch_makers import (
    BatchMakerOptions,
    GroupDecision,
    GrpoBatchMaker,
    batch_maker_class,
)
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.group_buffer import GroupBuffer
from rlpipe.rollouts.options import rollout_options


def group(gid: str, example: str, version: int, rewards=(0.0, 1.0)) -> Group:
    return Group(gid, "e", example, version, [f"{gid}:{j}" for j in range(len(rewards))], list(rewards))


def buffer_for(seed: int = 0, **rl) -> GroupBuffer:
    return GroupBuffer(rollout_options(RLConfig(**rl), seed=seed).buffer)


def rounds(seed: int):
    """A deterministic stream of sampling rounds: every other group zero-variance, ids unique."""
    counter = iter(range(10_000))

    def sample_round(attempt: int, n: int) -> list[Group]:
        out = []
        for _ in range(n):
            i = next(counter)
            out.append(group(f"g{i}", f"x{i}", 0, (1.0, 1.0) if i % 2 else (0.0, 1.0)))
        return out
    return sample_round


def run_steps(buffer: GroupBuffer, sample_round, steps: range) -> list[list[str]]:
    """The group ids of each step's batch, filling from `sample_round` (policy version = step - 1)."""
    out = []
    for step in steps:
        buffer.fill(step - 1, sample_round)
        batch, _ = buffer.take()
        out.append([g.group_id for g in batch])
    return out


CARRY = {"oversample_factor": 3.0, "max_staleness": 10}  # surplus groups wait for later steps
RESERVOIR = {"prompts_per_step": 3, "buffer": {**CARRY, "sampling": "reservoir", "reservoir_size": 5}}


def test_retention_latest_replaces_all_keeps_every_version():
    latest = GrpoBatchMaker(BatchMakerOptions(retention="latest", staleness_limit=5))
    every = GrpoBatchMaker(BatchMakerOptions(retention="all", staleness_limit=5))
    old, new = group("a0", "a", 0), group("a1", "a", 1)
    for maker in (latest, every):
        maker.add([old])
    decisions = latest.add([new])
    assert [(d.group.group_id, d.status) for d in decisions] == [("a0", "stale"), ("a1", "valid")]
    assert "replaced by group a1" in decisions[0].reason
    assert [d.status for d in every.add([new])] == ["valid"]
    assert [g.group_id for g in latest.groups] == ["a1"]
    assert [g.group_id for g in every.groups] == ["a0", "a1"]


def test_retention_max_age_bounds_age_by_its_own_field():
    maker = GrpoBatchMaker(BatchMakerOptions(retention="max_age", max_age=2, staleness_limit=0))
    maker.add([group("a0", "a", 0), group("a1", "a", 1), group("b2", "b", 2)])
    assert maker.start_batch(2) == []  # ages 2, 1, 0: all within max_age (the staleness limit 0 is not used)
    evicted = maker.start_batch(3)
    assert [d.group.group_id for d in evicted] == ["a0"] and evicted[0].status == "stale"
    assert "rl.buffer.max_age 2" in evicted[0].reason
    assert [g.group_id for g in maker.groups] == ["a1", "b2"]


def test_the_buffer_records_what_the_maker_drops_as_stale_decisions():
    buffer = buffer_for(prompts_per_step=2, buffer={"max_staleness": 5, "retention": "all"})
    buffer.start_batch(0)
    buffer.add([group("a0", "a", 0), group("a1", "a", 1)])
    assert [g.group_id for g in buffer.pending] == ["a0", "a1"]  # "all": both versions wait
    batch, metrics = buffer.take()
    assert [g.group_id for g in batch] == ["a0", "a1"] and buffer.pending == []
    assert metrics["rollout/batch_oldest_version"] == 0 and metrics["rollout/batch_newest_version"] == 1


def test_reservoir_draws_are_seeded_random_and_bounded():
    a = run_steps(buffer_for(seed=7, **RESERVOIR), rounds(0), range(1, 7))
    b = run_steps(buffer_for(seed=7, **RESERVOIR), rounds(0), range(1, 7))
    c = run_steps(buffer_for(seed=8, **RESERVOIR), rounds(0), range(1, 7))
    oldest = run_steps(buffer_for(seed=7, **{**RESERVOIR, "buffer": CARRY}), rounds(0), range(1, 7))
    assert a == b  # same seed, same batches
    assert a != c  # another seed draws others
    assert a != oldest  # not oldest first
    assert all(len(batch) == 3 for batch in a)
    buffer = buffer_for(seed=7, **RESERVOIR)
    buffer.start_batch(0)
    decisions = buffer.add([group(f"g{i}", f"x{i}", 0) for i in range(8)])  # 8 valid into a reservoir of 5
    assert len(buffer.pending) == 5 == len(buffer.maker.groups)
    evicted = [d for d in decisions if d.status == "stale"]
    assert len(evicted) == 3 and all("reservoir_size=5" in d.reason for d in evicted)
    assert {d.group.group_id for d in evicted}.isdisjoint(g.group_id for g in buffer.pending)


@pytest.mark.parametrize("buffer", [RESERVOIR["buffer"], {}, {"retention": "all"}], ids=["reservoir", "oldest", "all"])
def test_a_restored_buffer_makes_the_identical_next_batches(buffer):
    rl = {**RESERVOIR, "buffer": {**CARRY, **buffer}}
    straight = buffer_for(seed=3, **rl)
    sample_round = rounds(0)
    run_steps(straight, sample_round, range(1, 4))
    state = json.loads(json.dumps(straight.state_dict()))  # what data_state.json holds
    assert state["pending"], "the check needs groups carried across the cut"
    after = run_steps(straight, sample_round, range(4, 8))

    restored = buffer_for(seed=3, **rl)
    restored.load_state_dict(state)
    replayed = rounds(0)
    run_steps(buffer_for(seed=3, **rl), replayed, range(1, 4))  # the rounds' stream at the cut
    assert run_steps(restored, replayed, range(4, 8)) == after


def test_a_state_written_before_batch_makers_loads_its_pending_groups():
    old = {"pending": [group("a0", "a", 0).to_dict(), group("b0", "b", 0).to_dict()], "policy_version": 0,
           "attempts": 1, "batch_counts": {}, "total_counts": {"sampled_groups": 4}}
    buffer = buffer_for(prompts_per_step=2)
    buffer.load_state_dict(old)
    assert [g.group_id for g in buffer.take()[0]] == ["a0", "b0"]


def documented_example() -> str:
    """The batch maker docs/DESIGN.md shows under "Write a batch maker", as printed there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    section = text.split("#### Write a batch maker", 1)[1]
    return textwrap.dedent(section[section.index("    from rlpipe"):section.index("\nPut it in")])


USER_MAKER = documented_example()


def test_a_user_batch_maker_from_module_colon_class(tmp_path, monkeypatch):
    (tmp_path / "my_makers.py").write_text(USER_MAKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    buffer = buffer_for(prompts_per_step=2, buffer={"max_staleness": 5, "batch_maker": "my_makers:NewestFirst"})
    assert type(buffer.maker).__name__ == "NewestFirst"
    buffer.start_batch(2)
    decisions = buffer.add([group("a0", "a", 0), group("z", "z", 0, (1.0, 1.0)), group("b2", "b", 2),
                            group("c1", "c", 1)])
    assert [d.status for d in decisions] == ["valid", "zero_variance", "valid", "valid"]
    batch, metrics = buffer.take()
    assert [g.group_id for g in batch] == ["c1", "b2"]  # the user's order, not oldest first
    assert metrics["rollout/batch_newest_version"] == 2 and metrics["rollout/carried_groups"] == 1
    restored = buffer_for(prompts_per_step=1, buffer={"max_staleness": 5, "batch_maker": "my_makers:NewestFirst"})
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert [g.group_id for g in restored.pending] == ["a0"] and restored.take()[0][0].group_id == "a0"
    restored.maker.metadata = lambda batch: {"note": "text"}
    restored.add([group("d3", "d", 3)])
    with pytest.raises(TypeError, match="batch maker my_makers:NewestFirst: metadata 'note' is 'text'; its values must be numbers"):
        restored.take()


def test_bad_batch_maker_specs_are_one_line_naming_the_key(tmp_path, monkeypatch):
    from rlpipe.tasks.config import validate_config
    from rlpipe.tasks.preflight import _check_user_code

    with pytest.raises(ValueError, match="rl.buffer.batch_maker must be 'module:Class', got 'nocolon'"):
        RLConfig(buffer={"batch_maker": "nocolon"})
    (tmp_path / "half_maker.py").write_text("class Half:\n    def add(self, groups): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"rl.buffer.batch_maker 'half_maker:Half' must name a class .*missing: "
                                         r"create_batch, metadata, state_dict, load_state_dict"):
        batch_maker_class("half_maker:Half")
    for spec, why in [("no_such_module_xyz:C", "cannot import module"), ("half_maker:Nope", "has no attribute")]:
        config = validate_config({"flow": "rl", "rl": {"buffer": {"batch_maker": spec}}})
        with pytest.raises(ConfigError) as error:
            _check_user_code(config)
        message = str(error.value)
        assert message.startswith("rl.buffer.batch_maker") and why in message and "\n" not in message


def test_rl_buffer_section_is_checked():
    assert RLConfig().buffer.retention == "latest" and RLConfig().buffer.sampling == "oldest"
    with pytest.raises(ValueError, match=r"rl.buffer.reservoir_size \(2\) is smaller than rl.prompts_per_step \(4\)"):
        RLConfig(prompts_per_step=4, buffer={"sampling": "reservoir", "reservoir_size": 2})
    with pytest.raises(ValueError, match="retention"):
        RLConfig(buffer={"retention": "newest"})
    with pytest.raises(ValueError, match="reservoir' holds groups with non-zero advantages: it needs "
                                         "rl.filter.drop_zero_variance = true"):
        RLConfig(filter={"drop_zero_variance": False}, buffer={"sampling": "reservoir"})
    with pytest.raises(ValueError, match="oversample_factor"):
        RLConfig(oversample_factor=2)  # the buffer's fields live in [rl.buffer], not in [rl]
    assert RLConfig(buffer={"oversample_factor": 2}).buffer.oversample_factor == 2


def test_a_user_makers_groups_older_than_the_bound_are_dropped_as_stale(tmp_path, monkeypatch):
    (tmp_path / "keep_all.py").write_text(USER_MAKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    buffer = buffer_for(prompts_per_step=2, buffer={"max_staleness": 1, "batch_maker": "keep_all:NewestFirst"})
    buffer.start_batch(0)
    buffer.add([group("old", "o", 0)])
    fresh = iter(range(100))
    decisions = buffer.fill(5, lambda attempt, n: [group(f"f{next(fresh)}", "f", 5) for _ in range(n)])
    batch, metrics = buffer.take()
    assert [g.policy_version for g in batch] == [5, 5]
    too_old = [d for d in decisions if d.group.group_id == "old"]
    assert [d.status for d in too_old] == ["stale"] and "staleness limit 1" in too_old[0].reason
    assert metrics["rollout/stale_dropped"] == 1


class Stateless:
    """A batch maker's metadata and state methods, for makers that keep no state."""

    def metadata(self, batch):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Sloppy(Stateless):
    """A maker that decides only some of the groups it is given and makes batches of the wrong size."""

    def __init__(self, options):
        self.groups = []

    def add(self, groups):
        self.groups += groups
        return [GroupDecision(groups[0], groups[0].stats(), "valid")]

    def create_batch(self, size):
        return list(self.groups) if self.groups else None


def test_groups_a_maker_leaves_undecided_are_held_and_a_wrong_batch_size_is_named():
    buffer = buffer_for(prompts_per_step=2)
    buffer.maker = Sloppy(None)
    buffer.start_batch(0)
    decisions = buffer.add([group("a", "a", 0), group("b", "b", 0), group("c", "c", 0)])
    assert [(d.group.group_id, d.status) for d in decisions] == [("a", "valid"), ("b", "valid"), ("c", "valid")]
    assert [g.group_id for g in buffer.pending] == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"batch maker Sloppy: create_batch\(2\) returned 3 groups; it returns "
                                         r"exactly 2, or None"):
        buffer.take()
