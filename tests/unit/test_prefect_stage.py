"""Stages as plain calls (tracking.prefect_task_runs = false) keep their retries and results; a
stage's declared tables are written by the stage and read back on resume."""

from __future__ import annotations

import pytest
from rlpipe.core.stage_runs import call_with_retries, current_runner, plain_runner
from rlpipe.storage.stage_tables import stage
from rlpipe.tasks._prefect import prefect_runner, stage_task_runs


def _flaky(failures: int):
    calls = []

    def fn(value, *, retries="a stage argument of that name"):
        calls.append(retries)
        if len(calls) <= failures:
            raise ConnectionError(f"failure {len(calls)}")
        return value * 2

    return fn, calls


def test_plain_call_retries_then_returns():
    fn, calls = _flaky(failures=2)
    flaky = stage("flaky", retries=2, retry_delay_seconds=0.0)(fn)
    with stage_task_runs(False):
        assert flaky(21, retries="passed through") == 42
    assert calls == ["passed through"] * 3


def test_plain_call_raises_after_the_last_retry():
    fn, calls = _flaky(failures=5)
    with pytest.raises(ConnectionError, match="failure 3"):
        call_with_retries(fn, 2, 0.0, 1)
    assert len(calls) == 3


def test_plain_calls_outside_a_flow_task_runs_inside_the_block_and_restored_after():
    assert current_runner() is plain_runner  # a command over finished tables (rescore) runs no task
    with stage_task_runs(True):
        assert current_runner() is prefect_runner
        with stage_task_runs(False):
            assert current_runner() is plain_runner
        assert current_runner() is prefect_runner
    assert current_runner() is plain_runner


def _evals(step: int, reward: float) -> list[dict]:
    return [{"run_id": "r", "step": step, "env": "e", "example_id": "x", "reward": reward, "correct": True,
             "prompt_text": "", "completion_text": "", "sample": None, "answer": None}]  # greedy


def test_a_stage_writes_its_table_and_a_resumed_step_reads_it_back(tmp_path):
    from rlpipe.storage.stage_tables import StageTable
    from rlpipe.storage.writer import read_table

    calls = []

    def evaluate(reward, *, run_dir, run_id, step):
        calls.append(step)
        return _evals(step, reward)

    table = StageTable("evals", rows=lambda rows, a: rows, read_back=lambda rows, a: rows)
    evaluated = stage("eval", tables=(table,))(evaluate)
    with stage_task_runs(False):
        first = evaluated(0.5, run_dir=tmp_path, run_id="r", step=3)
        again = evaluated(0.9, run_dir=tmp_path, run_id="r", step=3)  # the step resumed: stored rows
    assert calls == [3]
    assert again == first == read_table(tmp_path, "evals", 3).to_pylist()
    assert again[0]["reward"] == 0.5


def test_rows_of_none_write_nothing_a_kept_partition_stays_and_check_runs_after_the_write(tmp_path):
    from rlpipe.storage.layout import partition_file
    from rlpipe.storage.stage_tables import StageTable
    from rlpipe.storage.writer import read_table

    def fails(rows):
        if rows and rows[0]["reward"] < 0:
            raise RuntimeError("checked after the write")

    table = StageTable("evals", rows=lambda rows, a: rows, keep_stored=lambda a: a["keep"])
    write = stage("eval", tables=(table,), check=fails)(
        lambda rows, *, run_dir, run_id, step, keep=False: rows)
    with stage_task_runs(False):
        assert write(None, run_dir=tmp_path, run_id="r", step=1) is None
        assert not partition_file(tmp_path, "evals", 1).exists()
        write(_evals(1, 0.5), run_dir=tmp_path, run_id="r", step=1)
        write(_evals(1, 0.7), run_dir=tmp_path, run_id="r", step=1, keep=True)  # kept as stored
        assert read_table(tmp_path, "evals", 1).column("reward").to_pylist() == [0.5]
        with pytest.raises(RuntimeError, match="checked after the write"):
            write(_evals(1, -1.0), run_dir=tmp_path, run_id="r", step=1)
    assert read_table(tmp_path, "evals", 1).column("reward").to_pylist() == [-1.0]


def test_the_eval_stage_reads_a_resumed_steps_evals_back_and_says_so(tmp_path, monkeypatch):
    import rlpipe.tasks.evaluate as evaluate
    from rlpipe.core import metric_names as m

    calls = []

    def greedy(engine, tokenizer, env, examples, *, run_id, step, **kwargs):
        calls.append(step)
        return _evals(step, 0.5), {}

    monkeypatch.setattr(evaluate, "evaluate_greedy", greedy)
    with stage_task_runs(False):
        first = evaluate.eval_step(None, None, None, [], run_dir=tmp_path, run_id="r", step=2)
        again = evaluate.eval_step(None, None, None, [], run_dir=tmp_path, run_id="r", step=2)
    assert calls == [2]  # evaluated once; the resumed step read its rows back
    assert (first.stored, again.stored) == (False, True)
    assert again.rows == first.rows and again.metrics == first.metrics == {m.EVAL_ACCURACY: 1.0, m.EVAL_REWARD: 0.5}


def test_a_step_whose_checkpoint_is_not_due_is_no_task_run_but_still_writes_its_row(tmp_path):
    """SFT's 40 steps showed 40 `checkpoint` task runs in the Prefect UI, most of them doing
    nothing: a step whose checkpoint is not due writes its `train_steps` row in a plain call."""
    from rlpipe.core.stage_runs import stage_runner
    from rlpipe.storage.stage_tables import StageTable
    from rlpipe.storage.writer import read_table
    from rlpipe.tasks.checkpoint import checkpoint_task

    task_runs = []

    def recording(name, fn, retries, retry_delay_s, args, kwargs):
        task_runs.append((name, kwargs["step"]))
        return fn(*args, **kwargs)

    row = {"run_id": "r", "step": 3, "mode": "sft"}
    with stage_runner(recording):
        assert checkpoint_task(train_row=row, checkpoint=False, run_dir=tmp_path, run_id="r", step=3) is None
        due = stage("due", tables=(StageTable("evals", rows=lambda result, a: result),),
                    works=lambda kwargs: kwargs["checkpoint"])(lambda *, checkpoint, run_dir, run_id, step:
                                                               _evals(step, 1.0))
        due(checkpoint=True, run_dir=tmp_path, run_id="r", step=4)
        due(checkpoint=False, run_dir=tmp_path, run_id="r", step=5)
    assert task_runs == [("due", 4)]
    assert read_table(tmp_path, "train_steps", 3).to_pylist()[0]["step"] == 3
    assert [r["step"] for r in read_table(tmp_path, "evals", 5).to_pylist()] == [5]
