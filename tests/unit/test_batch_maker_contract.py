"""Batch makers that break the training contract: one that hands back a group twice, replays a
trained group or rewrites its rewards, raises, returns no groups or keeps going through a SIGTERM
is stopped by the group buffer, in one line naming it. The makers that keep it are
test_batch_makers.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlpipe.rollouts.advantages import Group
from rlpipe.rollouts.batch_makers import BatchMakerError, GroupDecision
from rlpipe.rollouts.group_buffer import MAKER_STRIKES, GroupBuffer

from tests.unit.test_batch_makers import CARRY, Stateless, buffer_for, group, rounds


class Replaying(Stateless):
    """A configurable bad maker: `mode` says how its batches break the contract."""

    def __init__(self, mode: str):
        self.mode, self.groups, self.trained = mode, [], []

    def add(self, groups):
        if self.mode == "add raises":
            raise KeyError("boom\nsecond line")
        if self.mode == "decides a stranger":
            return [GroupDecision(group("stranger", "s", 0), group("stranger", "s", 0).stats(), "valid")]
        self.groups += groups

    def create_batch(self, size):
        if self.mode == "one group size times" and self.groups:
            return [self.groups[0]] * size
        if self.mode == "replays a trained group" and self.trained:
            return [self.trained[0]] * size
        if len(self.groups) < size:
            return None
        batch, self.groups = self.groups[:size], self.groups[size:]
        self.trained += batch
        if self.mode == "rewrites rewards":
            batch = [Group(g.group_id, g.env, g.example_id, g.policy_version, g.sample_ids, [9.0] * len(g.rewards))
                     for g in batch]
        if self.mode == "rewrites rewards in place":
            for g in batch:
                g.rewards[:] = [5.0] * len(g.rewards)
        if self.mode == "returns ids":
            return [g.group_id for g in batch]
        if self.mode == "returns a dict":
            return {g.group_id: g for g in batch}
        return batch


def bad_buffer(mode: str, **rl) -> GroupBuffer:
    buffer = buffer_for(**{"prompts_per_step": 2, "buffer": {"max_attempts": 50, **CARRY}, **rl})
    buffer.maker = Replaying(mode)
    return buffer


def trained_rows(buffer: GroupBuffer, steps: int) -> list[tuple[str, tuple]]:
    """(group_id, rewards) of every group each step trains (the buffer's sampling rounds)."""
    sample_round, out = rounds(0), []
    for step in range(1, steps + 1):
        buffer.fill(step - 1, sample_round)
        batch, _ = buffer.take()
        out += [(g.group_id, tuple(g.rewards)) for g in batch]
    return out


@pytest.mark.parametrize("mode", ["one group size times", "replays a trained group", "rewrites rewards",
                                  "rewrites rewards in place"])
def test_a_maker_never_gets_a_group_trained_twice_changed_or_replayed(mode):
    buffer = bad_buffer(mode)
    trained: list[tuple[str, tuple]] = []
    sample_round = rounds(0)
    with pytest.raises(BatchMakerError) as failed:
        for step in range(1, 6):
            buffer.fill(step - 1, sample_round)
            batch, _ = buffer.take()
            trained += [(g.group_id, tuple(g.rewards)) for g in batch]
    message = str(failed.value)
    assert message.startswith("batch maker Replaying: ") and "\n" not in message
    assert f"{MAKER_STRIKES} create_batch calls in a row gave no group it may train" in message
    ids = [gid for gid, _ in trained]
    assert len(ids) == len(set(ids))  # no group trained twice
    assert all(rewards == (0.0, 1.0) for _, rewards in trained)  # only the rewards the rounds scored


def test_a_replaying_maker_fails_in_a_few_calls_instead_of_asking_forever():
    buffer = bad_buffer("replays a trained group")
    buffer.fill(0, rounds(0))
    buffer.take()
    calls = []
    create = buffer.maker.create_batch
    buffer.maker.create_batch = lambda size: calls.append(size) or create(size)
    with pytest.raises(BatchMakerError, match="is not one it holds"):
        buffer.fill(1, rounds(1))
    assert len(calls) == MAKER_STRIKES


@pytest.mark.parametrize(("mode", "said"), [
    ("returns ids", r"batch maker Replaying: create_batch\(2\) returned 'g0' \(a str\) among its groups"),
    ("returns a dict", r"batch maker Replaying: create_batch\(2\) returned \{.*\(a dict\); it returns a list"),
    ("add raises", r"batch maker Replaying: add raised KeyError: 'boom"),
    ("decides a stranger", r"batch maker Replaying: add returned a decision about group 'stranger': it was not given"),
])
def test_a_maker_that_raises_or_returns_no_groups_fails_in_one_line_naming_it(mode, said):
    buffer = bad_buffer(mode)
    with pytest.raises(BatchMakerError, match=said) as failed:
        trained_rows(buffer, 2)
    assert "\n" not in str(failed.value)


def test_a_user_maker_is_named_by_its_spec(tmp_path, monkeypatch):
    (tmp_path / "raising_maker.py").write_text(
        "class Raising:\n    def __init__(self, options): pass\n    def add(self, groups): raise ValueError('no room')\n"
        "    def create_batch(self, size): return None\n    def metadata(self, batch): return {}\n"
        "    def state_dict(self): return {}\n    def load_state_dict(self, state): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    buffer = buffer_for(prompts_per_step=2, buffer={"batch_maker": "raising_maker:Raising"})
    with pytest.raises(BatchMakerError, match=r"^batch maker raising_maker:Raising: add raised ValueError: no room$"):
        buffer.fill(0, rounds(0))


SIGTERM_SCRIPT = """
import sys, time
from rlpipe.core.termination import sigterm_stops_the_run, Terminated
from rlpipe.rollouts import group_buffer
from tests.unit.test_batch_maker_contract import bad_buffer, rounds

group_buffer.MAKER_STRIKES = 10 ** 9  # as if the maker could make the buffer ask forever
buffer = bad_buffer("replays a trained group")
buffer.fill(0, rounds(0))
buffer.take()
create = buffer.maker.create_batch

def swallowing(size):  # a maker that catches everything, the signal's exception included
    try:
        time.sleep(0.001)
    except BaseException:
        pass
    return create(size)

buffer.maker.create_batch = swallowing
print("filling", flush=True)
started = time.monotonic()
try:
    with sigterm_stops_the_run():
        buffer.fill(1, rounds(1))
except Terminated:
    print(f"stopped after {time.monotonic() - started:.1f}s", flush=True)
    sys.exit(143)
"""


def test_sigterm_stops_a_fill_that_a_maker_keeps_going():
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "filling"
        time.sleep(1.0)
        proc.terminate()
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=10)
        assert time.monotonic() - sent < 5
    finally:
        proc.kill()
    assert proc.returncode == 143 and out.startswith("stopped after")
