"""rl.off_policy.partial_rollouts on the tiny pipeline: weight updates land inside sampling rounds, so some
completions span two policy versions; a SIGKILL and `rlpipe resume` lose no rollout and train none
twice; the staleness bound holds for every trained completion's oldest token; a step that trained
spanning completions replays bit for bit. It needs the real CLI and flow: the interruption is a
sync of the trainer's thread meeting the producer thread's decode loop."""

from __future__ import annotations

import os
import sys

import pytest

from tests import warm_cli
from tests.integration.test_async_rl import query, untracked_groups
from tests.integration.test_resume import ONE_THREAD, ROOT, cli, env_for, rows

pytestmark = pytest.mark.slow

HOOKS = ROOT / "tests" / "fault_hooks"

# The CLI, with each generate's first decode step held (at most 1 s) until a sync is waiting: the
# trainer's update then lands inside the round whenever the producer is sampling ahead (on a tiny
# model rounds are far shorter than a training step, so without it the landing is left to timing).
HELD_ROUNDS = """
import sys, time
from rlpipe.engines.snapshot import SnapshotEngine
generate, pause = SnapshotEngine.generate, SnapshotEngine._pause
def held_generate(self, prompts, params):
    self.held = False
    return generate(self, prompts, params)
def held_pause(self):
    if not self.held:
        self.held, deadline = True, time.monotonic() + 1.0
        while not self._syncs_waiting and time.monotonic() < deadline:
            time.sleep(0.002)
    pause(self)
SnapshotEngine.generate, SnapshotEngine._pause = held_generate, held_pause
from rlpipe.flows.cli import main
sys.exit(main(sys.argv[1:]))
"""

STEPS = 5


def versions(run_dir) -> set[tuple]:
    """(sample_id, policy_version, first_policy_version, last_policy_version) of every committed
    rollout (the table's snapshot: the producer may have renamed a file it never committed)."""
    from rlpipe.storage.writer import read_table

    columns = ["sample_id", "policy_version", "first_policy_version", "last_policy_version"]
    return {tuple(r.values()) for r in read_table(run_dir / "rl", "rollouts").select(columns).to_pylist()}


def test_partial_rollouts_span_versions_survive_sigkill_and_replay_exactly(tmp_path, prefect_api_url, capsys):
    runs = tmp_path / "runs"
    plain = env_for(tmp_path, prefect_api_url)
    env = {**plain, "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS), plain.get("PYTHONPATH")]))}
    args = ["run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=partial",
            "--set", "rl.checkpoint_every=1", "--set", f"rl.steps={STEPS}", "--set", "rl.off_policy.max_steps=1",
            "--set", "rl.off_policy.partial_rollouts=true", *ONE_THREAD]
    # killed by tests/fault_hooks as the producer, one step ahead, records step 4's advantages
    killed = warm_cli.run([sys.executable, "-c", HELD_ROUNDS, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, start_new_session=True,
                          env={**env, "RLPIPE_TEST_KILL": "after:*/rl/tables/advantages/step=4/part-0.parquet"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    before = versions(runs / "partial")
    assert any(first < last for _, _, first, last in before)  # some completions span two versions
    resumed = warm_cli.run(cli("resume", str(runs / "partial")), env=plain,  # without the fault hooks
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert before <= versions(runs / "partial")  # every sampled rollout kept, with the versions it had
    rl_dir = runs / "partial" / "rl"
    assert rows(runs / "partial", "train_steps") == STEPS
    assert untracked_groups(rl_dir) == 0
    # the bound on the oldest token; no token newer than the weights that trained it; none trained twice
    oldest, newest, order, trained, distinct = query(rl_dir, """
        select max(a.step - 1 - r.first_policy_version), min(a.step - 1 - r.last_policy_version),
               bool_and(r.policy_version <= r.first_policy_version and r.first_policy_version <= r.last_policy_version),
               count(*), count(distinct a.sample_id)
        from advantages a join rollouts r using (sample_id)""")[0]
    assert oldest <= 1 and newest >= 0 and order and trained == distinct > 0
    spanning = query(rl_dir, """
        select max(a.step) from advantages a join rollouts r using (sample_id)
        where r.first_policy_version < r.last_policy_version""")[0][0]
    assert spanning is not None  # spanning completions were trained

    from rlpipe.flows.cli import main

    code = main(["replay", str(rl_dir), "--step", str(spanning)])
    out = capsys.readouterr()
    assert code == 0 and f"OK: step {spanning} matches bit for bit" in out.out, out.out + out.err
