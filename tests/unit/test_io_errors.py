"""I/O failures named the same way whatever reported them (core/files.py), and a failed phase
marked failed in run.json and MLflow even when one of the two cannot be written."""

from __future__ import annotations

import errno
import json
import sqlite3

import pytest
from rlpipe.core.files import atomic_write, io_error, naming_io_errors
from rlpipe.flows.common import RunState, mark_failed
from rlpipe.storage.tracking import MlflowTracker, NullTracker

FULL = [
    OSError(errno.ENOSPC, "No space left on device"),  # Python's own write
    RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'),
    OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"),  # Arrow
    sqlite3.OperationalError("database or disk is full"),
]


@pytest.mark.parametrize("raised", FULL, ids=["python", "safetensors", "arrow", "sqlite"])
def test_a_full_disk_is_oserror_enospc_naming_the_path(raised, tmp_path):
    with pytest.raises(OSError) as caught, naming_io_errors(tmp_path / "f.bin"):
        raise raised
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "f.bin"))
    assert str(caught.value) == f"[Errno 28] No space left on device: '{tmp_path / 'f.bin'}'"
    wrapped = RuntimeError("table 'scores' step 3: background write failed")
    wrapped.__cause__ = caught.value
    assert io_error(wrapped) is caught.value


def test_other_errors_pass_unchanged(tmp_path):
    named = OSError(errno.EACCES, "Permission denied", "/elsewhere")
    for error in (ValueError("bad value"), named):
        with pytest.raises(type(error)) as caught, naming_io_errors(tmp_path):
            raise error
        assert caught.value is error
    assert io_error(ValueError("bad value")) is None
    assert io_error(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")) is None  # not storage
    unnamed = io_error(RuntimeError("(sqlite3.OperationalError) database or disk is full"))
    assert (unnamed.errno, unnamed.filename) == (errno.ENOSPC, None)


def test_an_atomic_write_on_a_full_disk_names_its_destination_and_leaves_nothing(tmp_path):
    def write(tmp):
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=rf"\[Errno 28\] No space left on device: '{tmp_path / 'run.json'}'"):
        atomic_write(tmp_path / "run.json", write)
    assert list(tmp_path.iterdir()) == []


class _Unwritable(NullTracker):
    def end(self, status="FINISHED"):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/mlflow.db")


def test_a_failed_phase_is_marked_failed_where_it_can_be(tmp_path, capsys, monkeypatch):
    """Afterwards: run.json says failed although MLflow could not be written, and the other way
    round; each failure to mark is one line on stderr naming the path and errno."""
    state = RunState(run_dir=tmp_path, run_id="r", phase="rl")
    state.save()
    mark_failed(state, _Unwritable())
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "failed"
    assert "could not mark the MLflow run failed: [Errno 28] No space left on device: '/runs/mlflow.db'" \
        in capsys.readouterr().err

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run.json"))

    monkeypatch.setattr(RunState, "save", full)
    tracker = NullTracker()
    mark_failed(state, tracker)
    assert tracker.status == "FAILED"
    assert f"could not mark run.json failed: [Errno 28] No space left on device: '{tmp_path / 'run.json'}'" \
        in capsys.readouterr().err


def test_metrics_that_could_not_be_written_fail_the_mlflow_run(tmp_path, monkeypatch):
    """Afterwards: ending the run FINISHED closes it FAILED and raises ENOSPC naming the store."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    log_batch = SqlAlchemyStore.log_batch

    def full(self, run_id, metrics=(), params=(), tags=()):
        if metrics:  # a full disk met by the metrics of a step
            raise sqlite3.OperationalError("database or disk is full")
        return log_batch(self, run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(SqlAlchemyStore, "log_batch", full)  # before the store binds it for async writes
    db = tmp_path / "mlflow.db"
    tracker = MlflowTracker(f"sqlite:///{db}", (tmp_path / "artifacts").as_uri())
    tracker.start(run_name="r", experiment="e")
    run_id = tracker.run_id
    tracker.log_metrics({"loss": 1.0}, step=1)
    with pytest.raises(OSError) as caught:
        tracker.end("FINISHED")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(db))
    assert tracker.client.get_run(run_id).info.status == "FAILED"
