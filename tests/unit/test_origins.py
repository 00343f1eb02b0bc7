"""Lineage pieces without MLflow (storage/lineage.py, tasks/origin.py): what is known of a
starting checkpoint, the `origins` row, and clear errors (tests/integration/test_lineage.py runs the whole chain on a real MLflow store)."""

from __future__ import annotations

import datetime as dt

from rlpipe.storage.lineage import checkpoint_origin, main, trained_by_step
from rlpipe.storage.tracking import NullTracker
from rlpipe.storage.writer import read_table, write_table
from rlpipe.tasks.origin import origin_task


def _sft_run(tmp_path):
    run_dir = tmp_path / "runs" / "demo" / "sft"
    checkpoint = run_dir / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    write_table(run_dir, "checkpoints", 2, [dict(
        run_id="demo/sft", step=2, policy_version=2, path=str(checkpoint.resolve()), mlflow_model_name="demo-sft",
        mlflow_model_version="3", created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))])
    return run_dir, checkpoint


def test_an_rlpipe_checkpoint_names_its_run_step_and_version(tmp_path):
    run_dir, checkpoint = _sft_run(tmp_path)
    assert checkpoint_origin(checkpoint) == {
        "parent_checkpoint": str(checkpoint.resolve()), "parent_run_dir": str(run_dir.resolve()),
        "parent_run_id": "demo/sft", "parent_step": 2, "parent_model_name": "demo-sft", "parent_model_version": "3"}


def test_any_other_folder_is_only_a_path(tmp_path):
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    assert checkpoint_origin(folder) == {"parent_checkpoint": str(folder.resolve())}


def test_origin_task_writes_the_step_0_row_and_nothing_for_a_preset(tmp_path):
    _, checkpoint = _sft_run(tmp_path)
    rl_dir = tmp_path / "runs" / "demo" / "rl"
    assert origin_task(None, NullTracker(), run_dir=rl_dir, run_id="demo/rl") is None
    assert not (rl_dir / "tables" / "origins").exists()
    row = origin_task(str(checkpoint), NullTracker(), run_dir=rl_dir, run_id="demo/rl")
    assert read_table(rl_dir, "origins", 0).to_pylist() == [row]
    assert row["parent_model_version"] == "3"


def test_trained_by_step_stops_at_the_versions_step(tmp_path):
    run_dir = tmp_path / "rl"
    for step in (1, 2, 3):
        write_table(run_dir, "advantages", step, [dict(run_id="r", step=step, sample_id=f"{step}:{i}", group_id=f"g{step}",
                                                       advantage=0.5) for i in range(step)])
    assert [(r["step"], r["samples"]) for r in trained_by_step(run_dir, 2)] == [(1, 1), (2, 2)]


def test_lineage_without_a_database_says_where_it_looked(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["models:/x/1", "--runs-root", str(tmp_path / "nowhere")]) == 2
    assert "no MLflow database at" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
