"""MLflow helpers on a throwaway SQLite store: nested runs, checkpoint versions, aliases."""

from __future__ import annotations

from pathlib import Path

import mlflow.artifacts
import pytest
from rlpipe.storage.model_versions import download_model
from rlpipe.storage.tracking import (
    MlflowTracker,
    NullTracker,
    default_artifact_root,
    default_tracking_uri,
    flatten_params,
)

from tests import warm_cli


def _checkpoint(folder: Path, marker: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "weights.txt").write_text(marker)
    return folder


def test_defaults_point_under_runs_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert default_artifact_root(tmp_path) == (tmp_path.resolve() / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert default_tracking_uri(tmp_path) == "http://tracking:5000"
    assert default_artifact_root(tmp_path) is None
    # a SQLite store named by the environment keeps artifacts beside it, not in ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere/mlflow.db")
    assert default_artifact_root(tmp_path) == (tmp_path.resolve() / "elsewhere" / "mlartifacts").as_uri()


def test_flatten_params():
    assert flatten_params({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {
        "a.b": "1",
        "a.c.d": "x",
        "e": "[1, 2]",
    }


def test_null_tracker_records_and_rejects_latest():
    tracker = NullTracker()
    with tracker.start("r", "e", params={"lr": 1e-3}):
        tracker.log_metrics({"train/loss": 1.0, "skip": None}, step=1)
        assert tracker.register_checkpoint("unused", "m") is None
        with pytest.raises(ValueError, match="reserved"):
            tracker.set_alias("m", "latest", "1")
    assert tracker.metrics == [(1, {"train/loss": 1.0})] and tracker.status == "FINISHED"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """One SQLite store for the module: creating one costs seconds of migrations."""
    return tmp_path_factory.mktemp("runs")


def test_mlflow_nested_runs_versions_and_aliases(runs_root, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    parent = MlflowTracker.for_runs_root(runs_root)
    parent.start("pipeline", "rlpipe-test", params={"rl": {"lr": 1e-4}}, tags={"kind": "pipeline"})
    child = MlflowTracker(parent.tracking_uri, parent.artifact_root)
    with child.start("rl", "rlpipe-test", parent=parent.run_id):
        child_id = child.run_id
        for step in (1, 2, 3):
            child.log_metrics({"train/loss": 1.0 / step}, step=step)
        child.log_dict({"steps": 3}, "config.json")
        first = child.register_checkpoint(_checkpoint(tmp_path / "step_000001", "one"), "tiny")
        second = child.register_checkpoint(
            _checkpoint(tmp_path / "step_000002", "two"), "tiny", tags={"step": "2"}
        )
        child.set_alias("tiny", "best", first)
        best = download_model(parent.tracking_uri, "models:/tiny@best", tmp_path / "best")
        assert (best / "weights.txt").read_text() == "one"
        child.set_alias("tiny", "best", second)  # move the alias
        with pytest.raises(ValueError, match="reserved"):
            child.set_alias("tiny", "latest", second)
    parent.end()
    assert (first, second) == ("1", "2")

    client = parent.client
    run = client.get_run(child_id)
    assert (
        run.data.tags["mlflow.parentRunId"]
        == client.search_runs([run.info.experiment_id], "tags.kind = 'pipeline'")[0].info.run_id
    )
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(child_id, "train/loss")] == pytest.approx(
        [1.0, 0.5, 1 / 3]
    )
    assert client.get_run(
        client.search_runs([run.info.experiment_id], "tags.kind = 'pipeline'")[0].info.run_id
    ).data.params == {"rl.lr": "0.0001"}
    # artifacts live under the runs root, not in the working directory
    assert run.info.artifact_uri.startswith((runs_root.resolve() / "mlartifacts").as_uri())
    # the documented plain-MLflow route, with the URI in the environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", parent.tracking_uri)
    moved = Path(
        mlflow.artifacts.download_artifacts("models:/tiny@best", dst_path=str(tmp_path / "b2"))
    )
    assert (moved / "weights.txt").read_text() == "two" and (moved / "config.json").is_file()
    newest = Path(
        mlflow.artifacts.download_artifacts("models:/tiny@latest", dst_path=str(tmp_path / "l"))
    )
    assert (newest / "weights.txt").read_text() == "two"


def test_failed_block_marks_run_failed(runs_root, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker.for_runs_root(runs_root)
    with pytest.raises(RuntimeError):
        with tracker.start("boom", "rlpipe-test"):
            run_id = tracker.run_id
            raise RuntimeError("stage failed")
    assert tracker.client.get_run(run_id).info.status == "FAILED"


def test_pinned_versions_and_a_retired_version(runs_root, tmp_path, monkeypatch):
    """Retention asks which versions an alias or `@latest` pins; a retired version keeps its number
    and tags, loses its artifact copy, and a download names why in one line."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker.for_runs_root(runs_root)
    with tracker.start("retention", "rlpipe-test"):
        assert tracker.pinned_versions("kept") == set()  # not registered yet
        versions = [tracker.register_checkpoint(_checkpoint(tmp_path / f"step_00000{i}", str(i)), "kept",
                                                tags={"step": str(i)}) for i in (1, 2, 3)]
        tracker.set_alias("kept", "best", versions[0])
        assert tracker.pinned_versions("kept") == {versions[0], versions[2]}  # best, and @latest
        tracker.retire_version("kept", versions[1], "removed by retention")
        tracker.retire_version("kept", versions[1], "a second pass")  # idempotent: the first reason stays
    retired = tracker.client.get_model_version("kept", versions[1])
    assert retired.tags["rlpipe.weights_removed"] == "removed by retention" and retired.tags["step"] == "2"
    assert not Path(retired.source.removeprefix("file://")).exists()
    with pytest.raises(ValueError, match=r"models:/kept/2 \(version 2\) has no weights: removed by retention"):
        download_model(tracker.tracking_uri, "models:/kept/2", tmp_path / "gone")
    assert (download_model(tracker.tracking_uri, "models:/kept@best", tmp_path / "b") / "weights.txt").read_text() == "1"


STORE_RACE = """
import sys, time
from rlpipe.storage.tracking import MlflowTracker
root, start_at, name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
while time.time() < start_at:  # every process imported MLflow: start together
    time.sleep(0.001)
tracker = MlflowTracker.for_runs_root(root)
tracker.start(run_name=name, experiment="sweep")
tracker.pinned_versions("sweep-model")
tracker.end()
"""


@pytest.mark.slow
def test_four_runs_starting_together_on_a_fresh_store_all_make_it(tmp_path, monkeypatch):
    """Runs started together on a fresh runs_root each make it: without the file lock under which the
    store is made, they failed in MLflow's first migration ("table ... already exists")."""
    import subprocess
    import sys
    import time

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    start_at = str(time.time() + 8)  # past every process's imports
    procs = [warm_cli.Popen([sys.executable, "-c", STORE_RACE, str(tmp_path / "runs"), start_at, f"r{i}"],
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [proc.communicate(timeout=180)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, [e.strip().splitlines()[-1:] for e in errors]
    client = MlflowTracker.for_runs_root(tmp_path / "runs").client
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1", "r2", "r3"]


def _training_checkpoint(folder: Path) -> Path:
    """A checkpoint laid out as training/checkpoint_io.py writes one: model files, training state,
    metadata.json hashing them all."""
    import json

    from rlpipe.training.checkpoint_files import file_hashes

    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(b"w" * 40_000)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "optimizer.pt").write_bytes(b"o" * 80_000)
    (folder / "rng_state.pt").write_bytes(b"r" * 100)
    (folder / "data_state.json").write_text('{"cursor": 3}')
    hashes = file_hashes(folder)
    (folder / "metadata.json").write_text(json.dumps(
        {"step": 4, "sha256": "abc", "weight_files": {"model.safetensors": hashes["model.safetensors"]},
         "files": hashes}))
    return folder


def test_a_version_links_the_model_files_and_leaves_the_training_state_out(runs_root, tmp_path, monkeypatch):
    """A registered version holds the weights, config and tokenizer as hard links to the checkpoint's
    files (no second copy), never optimizer.pt, rng_state.pt or data_state.json; its metadata.json
    says what is left out and where to resume from, and a download of it loads and verifies."""
    import json

    from rlpipe.storage.model_artifacts import artifact_bytes, local_artifact_path
    from rlpipe.training.checkpoint_files import verify_checkpoint

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    checkpoint = _training_checkpoint(tmp_path / "run" / "checkpoints" / "step_000004")
    tracker = MlflowTracker.for_runs_root(runs_root)
    with tracker.start("linked", "rlpipe-test"):
        version = tracker.register_checkpoint(checkpoint, "linked-model", tags={"step": "4", "sha256": "abc"})
    found = tracker.client.get_model_version("linked-model", version)
    stored = local_artifact_path(found.source)
    assert sorted(p.name for p in stored.iterdir()) == ["config.json", "metadata.json", "model.safetensors",
                                                        "tokenizer.json"]
    assert (stored / "model.safetensors").stat().st_ino == (checkpoint / "model.safetensors").stat().st_ino
    assert found.tags["rlpipe.artifact_files"] == "linked"
    assert found.tags["rlpipe.left_out"] == "optimizer.pt rng_state.pt data_state.json"
    manifest = json.loads((stored / "metadata.json").read_text())
    assert manifest["left_out"] == ["optimizer.pt", "rng_state.pt", "data_state.json"]
    assert manifest["resume_from"] == str(checkpoint.resolve()) and "optimizer.pt" not in manifest["files"]
    assert json.loads((checkpoint / "metadata.json").read_text())["files"]["optimizer.pt"]  # the checkpoint's own
    downloaded = download_model(tracker.tracking_uri, "models:/linked-model/" + version, tmp_path / "down")
    assert verify_checkpoint(downloaded)["step"] == 4 and not (downloaded / "optimizer.pt").exists()
    sizes = artifact_bytes([stored], checkpoint.parent.parent)
    assert sizes["linked"] == 40_000 + 2 + len('{"model_type": "qwen3"}') and 0 < sizes["own"] < 2000


def test_a_version_is_copied_where_the_filesystem_refuses_a_link(runs_root, tmp_path, monkeypatch):
    import errno
    import os

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    checkpoint = _training_checkpoint(tmp_path / "step_000004")
    tracker = MlflowTracker.for_runs_root(runs_root)
    with tracker.start("copied", "rlpipe-test"):
        version = tracker.register_checkpoint(checkpoint, "copied-model")
    found = tracker.client.get_model_version("copied-model", version)
    assert found.tags["rlpipe.artifact_files"] == "copied"
    stored = Path(found.source.removeprefix("file://"))
    assert (stored / "model.safetensors").read_bytes() == b"w" * 40_000 and not (stored / "optimizer.pt").exists()


def test_a_remote_store_gets_the_model_files_uploaded_and_no_staging_left(tmp_path):
    """An MLflow server's store (mlflow-artifacts:/, s3://): the model files are uploaded from a
    hidden staging folder of hard links beside the checkpoint, which is gone afterwards."""
    from types import SimpleNamespace

    from rlpipe.storage.model_artifacts import local_artifact_path, log_model_files

    uploaded = {}

    class Client:
        def get_run(self, run_id):
            return SimpleNamespace(info=SimpleNamespace(artifact_uri="mlflow-artifacts:/3/abc/artifacts"))

        def log_artifacts(self, run_id, folder, artifact_path):
            uploaded[artifact_path] = sorted(p.name for p in Path(folder).iterdir())

    checkpoint = _training_checkpoint(tmp_path / "checkpoints" / "step_000004")
    tags = log_model_files(Client(), "abc", checkpoint, "checkpoints/step_000004")
    assert tags == {"rlpipe.artifact_files": "uploaded", "rlpipe.left_out": "optimizer.pt rng_state.pt data_state.json"}
    assert uploaded == {"checkpoints/step_000004": ["config.json", "metadata.json", "model.safetensors", "tokenizer.json"]}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]
    assert local_artifact_path("s3://bucket/x") is None and local_artifact_path("file:///a%20b/c") == Path("/a b/c")


def test_ending_one_run_drains_the_shared_metric_queue_and_the_other_run_logs_on(tmp_path, monkeypatch):
    """Runs on one store share MLflow's metric queue: ending one writes everything queued (its
    own metrics, and the other run's) before the run closes, and the other run's later metrics
    start the queue again and are all there when it ends."""
    monkeypatch.delenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, second = MlflowTracker(uri).start("first", "queue"), MlflowTracker(uri).start("second", "queue")
    import os

    # MLflow's thread waits on its stop event between batches, so the drain wakes it at once
    assert os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] == "1"
    first_id, second_id = first.run_id, second.run_id
    for step in range(1, 4):
        first.log_metrics({"loss": float(step)}, step=step)
        second.log_metrics({"loss": 10.0 * step}, step=step)
    first.end()
    client = first.client
    assert [m.value for m in client.get_metric_history(first_id, "loss")] == [1.0, 2.0, 3.0]
    assert len(client.get_metric_history(second_id, "loss")) == 3  # drained with the first's
    assert client.get_run(first_id).info.status == "FINISHED"
    second.log_metrics({"loss": 40.0}, step=4)
    second.end()
    assert [m.value for m in client.get_metric_history(second_id, "loss")] == [10.0, 20.0, 30.0, 40.0]
    assert client.get_run(second_id).info.status == "FINISHED"
