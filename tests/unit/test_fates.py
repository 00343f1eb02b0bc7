"""Per-completion fates (rollouts/fates.py): what the buffer and the source decide, as rows."""

from __future__ import annotations

import pytest
from rlpipe.envs.base import Example
from rlpipe.envs.prompts import PromptSource
from rlpipe.rollouts.advantages import Group
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.fates import (
    STATUSES,
    decide_groups,
    fate_metrics,
    fate_rows,
    sample_drop,
    select_step,
)
from rlpipe.rollouts.group_buffer import BatchFillError, GroupBuffer
from rlpipe.rollouts.options import rollout_options
from rlpipe.rollouts.records import Rollout, Score
from rlpipe.rollouts.source import RolloutSource


def group(gid: str, example: str, version: int, rewards: list[float]) -> Group:
    return Group(gid, "e", example, version, [f"{gid}:{j}" for j in range(len(rewards))], rewards)


def rollout(sid: str, finish_reason: str = "stop") -> Rollout:
    return Rollout(run_id="r", step=1, policy_version=0, env="e", example_id="x", group_id=sid[:-2], sample_id=sid,
                   attempt=1, prompt_tokens=[1], completion_tokens=[2], completion_logprobs=[-1.0],
                   finish_reason=finish_reason, prompt_text="", completion_text="", n_prompt_tokens=1,
                   n_completion_tokens=1)


def test_a_replaced_group_is_recorded_stale_not_left_carried():
    buffer = GroupBuffer(rollout_options(RLConfig(prompts_per_step=2, buffer={"max_staleness": 5})).buffer)
    buffer.start_batch(0)
    buffer.add([group("old", "a", 0, [0, 1])])
    buffer.start_batch(1)
    decisions = buffer.add([group("new", "a", 1, [0, 1]), group("older", "a", 0, [1, 0])])
    assert [(d.group.group_id, d.status) for d in decisions] == [("old", "stale"), ("new", "valid"),
                                                                ("older", "stale")]
    assert "replaced by group new" in decisions[0].reason and "newer policy version 1" in decisions[2].reason
    rows = fate_rows(decide_groups([], decisions, step=2))
    assert {(r["sample_id"], r["status"]) for r in rows} == {
        ("old:0", "stale"), ("old:1", "stale"), ("new:0", "carried"), ("new:1", "carried"),
        ("older:0", "stale"), ("older:1", "stale")}


def test_a_group_decided_twice_in_a_step_keeps_its_last_decision_and_the_batch_is_trained():
    buffer = GroupBuffer(rollout_options(RLConfig(prompts_per_step=1, buffer={"max_staleness": 5})).buffer)
    buffer.start_batch(0)
    decisions = buffer.add([group("a0", "a", 0, [0, 1]), group("a1", "a", 1, [0, 1]), group("z", "b", 1, [1, 1])])
    batch, _ = buffer.take()
    rows = fate_rows(decide_groups(batch, decisions, step=1))
    by_sample = {r["sample_id"]: r for r in rows}
    assert len(rows) == len(by_sample) == 6  # one row per completion
    assert by_sample["a0:0"]["status"] == "stale"
    assert by_sample["a1:0"]["status"] == "trained" and "trained at step 1" in by_sample["a1:0"]["reason"]
    assert by_sample["z:1"]["status"] == "zero_variance" and "std 0 <= eps 1e-06" in by_sample["z:1"]["reason"]
    metrics = fate_metrics(rows, buffer.pending)
    assert metrics["rollout/fate_trained"] == 2 and metrics["rollout/fate_stale"] == 2
    assert metrics["rollout/fate_zero_variance"] == 2 and metrics["rollout/fate_carried"] == 0
    assert set(metrics) == {f"rollout/fate_{s}" for s in STATUSES}


def test_sample_drops_name_the_reason():
    rl = rollout_options(RLConfig(filter={"drop_truncated": True}, sampling={"max_new_tokens": 7})).drops
    ok = Score("r", 1, "g:0", "g", 1.0, {}, None)
    assert sample_drop(rollout("g:0"), ok, rl) is None
    assert sample_drop(rollout("g:0", "length"), ok, rl) == (
        "truncated", "cut at rl.sampling.max_new_tokens=7 (finish_reason 'length') and rl.filter.drop_truncated is on")
    assert sample_drop(rollout("g:0", "length"), ok, rollout_options(RLConfig()).drops) is None  # trained by default
    failed = Score("r", 1, "g:0", "g", 0.0, {}, "ZeroDivisionError: boom\nTraceback ...")
    assert sample_drop(rollout("g:0"), failed, rl) == ("reward_error", "reward function raised: ZeroDivisionError: boom")


def keep_short(rollout, score):
    """A user filter for the test below: completions over one token are dropped, with a reason."""
    return True if rollout.n_completion_tokens <= 1 else f"{rollout.n_completion_tokens} tokens"


def test_a_user_filter_drops_completions_as_filtered():
    rl = rollout_options(RLConfig(filter={"sample_filter": "tests.unit.test_fates:keep_short"})).drops
    ok = Score("r", 1, "g:0", "g", 1.0, {}, None)
    assert sample_drop(rollout("g:0"), ok, rl) is None
    long = Rollout(**{**rollout("g:0").row(), "completion_tokens": [2, 3], "n_completion_tokens": 2})
    assert sample_drop(long, ok, rl) == ("filtered", "tests.unit.test_fates:keep_short: 2 tokens")
    nothing = rollout_options(RLConfig(filter={"sample_filter": "tests.unit.test_fates:nothing"})).drops
    with pytest.raises(ValueError, match="rl.filter.sample_filter 'tests.unit.test_fates:nothing'"):
        sample_drop(rollout("g:0"), ok, nothing)


class Stages:
    """Four completions per prompt (rewards 0, 1, 1, 1), the first one's reward raising; with
    `flat`, only the first group of round 1 has unequal rewards. Records the source's fate rows."""

    def __init__(self, flat: bool = False) -> None:
        self.flat, self.fates = flat, {}

    def generate(self, examples, *, step, attempt, policy_version, previous):
        return [Rollout(run_id="r", step=step, policy_version=policy_version, env=e.env, example_id=e.example_id,
                        group_id=f"s{step}a{attempt}g{i}", sample_id=f"s{step}a{attempt}g{i}:{j}", attempt=attempt,
                        prompt_tokens=[1], completion_tokens=[2], completion_logprobs=[-1.0], finish_reason="stop",
                        prompt_text="", completion_text=str(j), n_prompt_tokens=1, n_completion_tokens=1)
                for i, e in enumerate(examples) for j in range(4)]

    def score(self, examples, rollouts, *, step, previous):
        def reward(r):
            return 1.0 if self.flat and not r.group_id.endswith("a1g0") else float(r.completion_text != "1")
        return [Score("r", step, r.sample_id, r.group_id, reward(r), {},
                      "ValueError: no" if r.completion_text == "0" else None) for r in rollouts]

    def select(self, fill, rows, options, *, step, empty):
        selection = select_step(fill, rows, options, step=step)
        self.fates[step] = selection.decisions
        return selection


def source(rl: RLConfig, stages: Stages) -> RolloutSource:
    examples = [Example("e", str(i), f"q{i}", None) for i in range(100)]
    options = rollout_options(rl)
    return RolloutSource(options, PromptSource(examples, seed=0), GroupBuffer(options.buffer), stages, start_step=0,
                         published_version=0)


def test_every_sampled_completion_gets_one_final_fate_and_the_metrics_count_them():
    stages = Stages()
    rl = RLConfig(steps=3, prompts_per_step=2, buffer={"oversample_factor": 2.0})
    logged = []
    with source(rl, stages) as src:
        for step in range(1, 4):
            logged.append(src.batch(step).metrics)
            src.publish(step)
    final = {}
    for step in sorted(stages.fates):
        final |= {r["sample_id"]: (step, r["status"]) for r in stages.fates[step]}
    statuses = [status for _, status in final.values()]
    assert statuses.count("reward_error") == len(final) // 4  # completion 0 of every group
    assert statuses.count("trained") == 3 * 2 * 3  # 3 steps x 2 groups x 3 scored completions
    for status in STATUSES:
        if status != "carried":
            assert sum(m[f"rollout/fate_{status}"] for m in logged) == statuses.count(status)
    assert logged[-1]["rollout/fate_carried"] == statuses.count("carried") > 0


def test_a_step_that_cannot_fill_its_batch_records_its_samples_before_failing():
    stages = Stages(flat=True)  # one valid group in two rounds, for a batch of two
    rl = RLConfig(steps=1, prompts_per_step=2, buffer={"max_attempts": 2})
    with source(rl, stages) as src, pytest.raises(BatchFillError) as error:
        src.batch(1)
    rows = stages.fates[1]
    assert len(rows) == len({r["sample_id"] for r in rows}) == 4 * (2 + 2)  # round 2: 1 missing / valid share 1/2
    over = [r for r in rows if r["status"] == "over_cap"]
    assert [r["sample_id"] for r in over] == ["s1a1g0:1", "s1a1g0:2", "s1a1g0:3"]
    assert "rl.buffer.max_attempts=2" in over[0]["reason"] and "the run stopped" in over[0]["reason"]
    assert {r["status"] for r in rows} == {"reward_error", "zero_variance", "over_cap"}
    # the counters the flow logs before the run stops equal those rows
    assert error.value.metrics["rollout/fate_over_cap"] == len(over)
    assert error.value.metrics["rollout/fate_zero_variance"] == sum(r["status"] == "zero_variance" for r in rows)


def test_the_rl_flow_logs_a_failed_steps_fate_counters_before_stopping():
    from rlpipe.flows.rl import _step_batch
    from rlpipe.storage.tracking import NullTracker

    class FailingSource:
        def batch(self, step):
            error = BatchFillError("step 3 could not fill its batch")
            error.metrics = {"rollout/fate_over_cap": 24.0, "rollout/fate_zero_variance": 40.0}
            raise error

    tracker = NullTracker()
    with pytest.raises(BatchFillError, match="step 3") as error:
        _step_batch(FailingSource(), 3, tracker, RLConfig(buffer={"max_attempts": 3}).buffer)
    assert tracker.metrics == [(3, {"rollout/fate_over_cap": 24.0, "rollout/fate_zero_variance": 40.0})]
    # what the run's last line tells a resume to change: twice the rounds, partial batches
    assert error.value.resume_settings == ["rl.buffer.max_attempts=6", "rl.buffer.partial_batches=true"]


def test_the_groups_rows_and_the_decisions_rows_read_one_decision():
    from rlpipe.rollouts.fates import Fill
    from rlpipe.rollouts.selection import advantage_rows, group_rows

    buffer = GroupBuffer(rollout_options(RLConfig(prompts_per_step=1, buffer={"max_staleness": 5})).buffer)
    buffer.start_batch(0)
    decisions = buffer.add([group("a0", "a", 0, [0, 1]), group("a1", "a", 1, [0, 1]), group("z", "b", 1, [1, 1]),
                            group("c", "c", 1, [1, 0])])
    batch, _ = buffer.take()
    rows = {sid: rollout(sid) for g in batch for sid in g.sample_ids}
    selection = select_step(Fill(batch, decisions, [(rollout("d:0"), "truncated", "cut")]), rows,
                            rollout_options(RLConfig()).advantages, step=1)
    by_group = {r["group_id"]: r["status"] for r in group_rows(selection.fates, run_id="r", step=1)}
    by_sample = {r["group_id"]: r["status"] for r in selection.decisions}
    assert by_group == {"a0": "stale", "a1": "trained", "z": "zero_variance", "c": "carried"}
    assert by_sample == by_group | {"d": "truncated"}
    assert [(r["sample_id"], r["advantage"]) for r in advantage_rows(selection, run_id="r", step=1)] == [
        ("a1:0", -0.5), ("a1:1", 0.5)]


def test_the_filter_stage_writes_its_tables_and_reads_carried_rows_from_the_step_that_sampled_them(tmp_path):
    from rlpipe.rollouts.fates import Fill
    from rlpipe.rollouts.selection import filter_stage
    from rlpipe.storage.writer import read_table, write_table
    from rlpipe.tasks._prefect import stage_task_runs

    sampled = [Rollout(**{**rollout(f"r:s000001:a1:g0000:00{j}").row(), "group_id": "r:s000001:a1:g0000"})
               for j in range(2)]
    write_table(tmp_path, "rollouts", 1, [r.row() for r in sampled], run_id="r")  # before a resume
    carried = Group("r:s000001:a1:g0000", "e", "x", 0, [r.sample_id for r in sampled], [0.0, 1.0])
    buffer = GroupBuffer(rollout_options(RLConfig(prompts_per_step=1)).buffer)
    buffer.load_state_dict({"pending": [carried.to_dict()], "policy_version": 0, "attempts": 0,
                            "batch_counts": {}, "total_counts": {}})
    batch, _ = buffer.take()
    with stage_task_runs(False):
        selection = filter_stage(Fill(batch, [], []), {}, rollout_options(RLConfig()).advantages, step=2,
                                 empty=True, run_dir=tmp_path, run_id="r")
    assert [s.rollout for s in selection.samples] == sampled
    assert read_table(tmp_path, "rollouts", 2).num_rows == read_table(tmp_path, "scores", 2).num_rows == 0
    assert read_table(tmp_path, "groups", 2).column("status").to_pylist() == ["trained"]
    assert read_table(tmp_path, "decisions", 2).column("status").to_pylist() == ["trained", "trained"]
    assert read_table(tmp_path, "advantages", 2).column("advantage").to_pylist() == [-0.5, 0.5]
