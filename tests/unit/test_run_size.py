"""The run folder's size in the run summary: tables, checkpoints and the rest, pipeline phases
included."""

from __future__ import annotations

from rlpipe.storage.layout import human_bytes, run_folder_bytes


def test_run_folder_bytes_by_kind(tmp_path):
    (tmp_path / "rl" / "tables" / "scores" / "step=1").mkdir(parents=True)
    (tmp_path / "rl" / "tables" / "scores" / "step=1" / "part-0.parquet").write_bytes(b"x" * 300)
    (tmp_path / "sft" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "sft" / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"x" * 5000)
    (tmp_path / "rl" / "run.json").write_text("{}")
    assert run_folder_bytes(tmp_path) == {"tables": 300, "checkpoints": 5000, "other": 2, "total": 5302}


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 7 * 2**30, 3 * 2**50)] == \
        ["0 B", "1023 B", "1 KiB", "1.5 KiB", "7 GiB", "3072 TiB"]


def test_the_summary_prints_the_run_folder_size(tmp_path):
    from rlpipe.flows.runner import summary_lines
    from rlpipe.tasks.config import validate_config

    config = validate_config({"runs_root": str(tmp_path), "run_name": "sized", "flow": "rl"})
    (config.run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (config.run_dir / "checkpoints" / "step_000001" / "model.safetensors").write_bytes(b"x" * 2048)
    lines = summary_lines(config, {}, 1.0)
    assert "  run folder 2 KiB: tables 0 B, checkpoints 2 KiB, other 0 B" in lines


def test_the_summary_says_when_rl_lost_accuracy(tmp_path):
    from rlpipe.flows.runner import summary_lines
    from rlpipe.tasks.config import validate_config

    config = validate_config({"runs_root": str(tmp_path), "run_name": "worse", "flow": "pipeline"})
    phases = lambda sft, rl: {"sft": {"eval": {"eval/accuracy": sft}}, "rl": {"eval": {"eval/accuracy": rl}}}  # noqa: E731
    worse = summary_lines(config, phases(0.15, 0.0), 1.0)
    assert "  warning: RL lowered held-out accuracy from 15.0% to 0.0%; the RL phase made the model worse " \
           "(see its reward_by_step and zero_variance_by_step below)" in worse
    assert not any("warning" in line for line in summary_lines(config, phases(0.15, 0.15), 1.0))


def test_the_summary_counts_the_mlflow_artifacts_the_run_wrote(tmp_path, monkeypatch):
    """The size summary counts what the run's MLflow runs keep under runs_root/mlartifacts: hard
    links to the checkpoints' files take no space of their own, anything else adds to the total."""
    import os

    from rlpipe.flows.runner import summary_lines
    from rlpipe.tasks.config import validate_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = validate_config({"runs_root": str(tmp_path), "run_name": "sized", "flow": "pipeline"})
    weights = config.run_dir / "rl" / "checkpoints" / "step_000001" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"x" * 4096)
    (config.run_dir / "rl" / "run.json").write_text('{"mlflow_run_id": "abc123"}')
    (config.run_dir / "run.json").write_text('{"mlflow_run_id": null}')
    stored = tmp_path / "mlartifacts" / "rlpipe" / "abc123" / "artifacts" / "checkpoints" / "step_000001"
    stored.mkdir(parents=True)
    os.link(weights, stored / "model.safetensors")
    (stored / "metadata.json").write_bytes(b"m" * 1024)
    (tmp_path / "mlartifacts" / "rlpipe" / "other-run").mkdir()
    (tmp_path / "mlartifacts" / "rlpipe" / "other-run" / "big").write_bytes(b"y" * 9999)  # not this run's
    lines = summary_lines(config, {}, 1.0)
    assert "  run folder 4.05 KiB: tables 0 B, checkpoints 4 KiB, other 50 B" in lines
    assert f"  MLflow artifacts 5 KiB in {tmp_path.resolve() / 'mlartifacts'}: 4 KiB hard links to checkpoint " \
           "files (no space of their own), 1 KiB of their own; written in all 5.05 KiB" in lines


def test_a_supervised_runs_summary_points_at_queries_that_have_rows(tmp_path):
    """An SFT run samples nothing: its summary names the loss and eval queries, not reward_by_step
    (0 rows, and a note that `scores` has no data)."""
    from rlpipe.flows.runner import summary_lines
    from rlpipe.tasks.config import validate_config

    sft = summary_lines(validate_config({"runs_root": str(tmp_path), "run_name": "s", "flow": "sft"}), {}, 1.0)
    assert f"  rlpipe sql {tmp_path.resolve() / 's'} --query loss_by_step" in sft
    assert not any("reward" in line or "scores" in line for line in sft)
    rl = summary_lines(validate_config({"runs_root": str(tmp_path), "run_name": "r", "flow": "rl"}), {}, 1.0)
    assert f"  rlpipe sql {tmp_path.resolve() / 'r'} --query reward_by_step" in rl
