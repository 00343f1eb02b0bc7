"""The ordered background table writer: FIFO, a prefix on disk after SIGKILL, errors that
surface naming the table and step, snapshots of the caller's rows, and `persist` routing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rlpipe.storage.background_writer import BackgroundWriter, TableWriteError
from rlpipe.storage.compaction import fresh_files
from rlpipe.storage.stage_tables import (
    background_writes,
    drain_writes,
    load_rows,
    load_rows_beyond,
    persist,
)
from rlpipe.storage.writer import read_table

from tests.leftovers import strays

ROOT = Path(__file__).resolve().parents[2]


def step_row(step: int, loss: float) -> dict:
    return {"run_id": "r", "step": step, "mode": "rl", "loss": loss, "tokens": step}


def test_last_write_of_a_partition_wins_and_every_write_lands(tmp_path):
    with BackgroundWriter() as writer:
        for step in range(1, 6):
            for version in range(3):  # rewrites of one partition, as sampling rounds do
                writer.submit(tmp_path, "train_steps", step, [step_row(step, float(version))], run_id="r")
    table = read_table(tmp_path, "train_steps").to_pylist()
    assert [(row["step"], row["loss"]) for row in table] == [(step, 2.0) for step in range(1, 6)]


def test_a_failed_write_names_its_table_and_step_and_stops_later_writes(tmp_path):
    writer = BackgroundWriter()
    writer.submit(tmp_path, "train_steps", 1, [step_row(1, 0.5)], run_id="r")
    writer.submit(tmp_path, "train_steps", 2, [{"step": 2, "no_such_column": 1}], run_id="r")
    writer.submit(tmp_path, "train_steps", 3, [step_row(3, 0.5)], run_id="r")
    with pytest.raises(TableWriteError, match=r"'train_steps' step 2.*no_such_column") as raised:
        writer.drain()
    assert isinstance(raised.value.__cause__, ValueError)
    assert (raised.value.table, raised.value.step) == ("train_steps", 2)
    # a prefix on disk: the write after the failed one was dropped, not written out of order
    assert [step for step, _ in fresh_files(tmp_path, "train_steps")] == [1]
    with pytest.raises(TableWriteError, match="step 2"):  # sticky: the next persist fails too
        writer.submit(tmp_path, "train_steps", 4, [step_row(4, 0.5)], run_id="r")
    writer.close(raise_errors=False)


def test_submit_snapshots_rows_the_caller_changes_later(tmp_path):
    rows = [step_row(1, 0.25)]
    with BackgroundWriter() as writer:
        writer.submit(tmp_path, "train_steps", 1, rows, run_id="r")
        rows[0]["loss"] = 99.0
        rows.append(step_row(1, 7.0))
    assert read_table(tmp_path, "train_steps", 1).column("loss").to_pylist() == [0.25]


def test_unknown_table_fails_at_submit(tmp_path):
    with BackgroundWriter() as writer, pytest.raises(ValueError):
        writer.submit(tmp_path, "no_such_table", 1, [], run_id="r")


def test_persist_queues_inside_the_block_and_reads_see_own_writes(tmp_path):
    with background_writes() as writer:
        persist(tmp_path, "train_steps", 1, [step_row(1, 0.5)], "r")
        persist(tmp_path, "train_steps", 2, [step_row(2, 0.5)], "r")
        assert writer.pending() + len(fresh_files(tmp_path, "train_steps")) >= 2
        assert load_rows(tmp_path, "train_steps", 2)[0]["loss"] == 0.5  # waits for its own write
        persist(tmp_path, "train_steps", 3, [step_row(3, 0.5), step_row(3, 0.7)], "r")
        assert len(load_rows_beyond(tmp_path, "train_steps", 3, known=1)) == 2
        persist(tmp_path, "train_steps", 4, [step_row(4, 0.5)], "r")
        drain_writes()
        assert writer.pending() == 0
    assert [step for step, _ in fresh_files(tmp_path, "train_steps")] == [1, 2, 3, 4]
    persist(tmp_path, "train_steps", 5, [step_row(5, 0.5)], "r")  # outside: written at once
    assert load_rows(tmp_path, "train_steps", 5) is not None


def test_leaving_the_block_on_an_error_writes_the_queue_and_keeps_the_error(tmp_path):
    with pytest.raises(KeyError, match="stage failed"), background_writes():
        persist(tmp_path, "train_steps", 1, [step_row(1, 0.5)], "r")
        raise KeyError("stage failed")
    assert load_rows(tmp_path, "train_steps", 1) is not None


def test_sigkill_leaves_a_prefix_of_the_writes_and_no_partial_file(tmp_path):
    total = 3000
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rlpipe.storage.background_writer import BackgroundWriter
        writer = BackgroundWriter()
        for step in range(1, {total} + 1):
            writer.submit({str(tmp_path)!r}, "train_steps", step,
                          [{{"run_id": "r", "step": step, "mode": "rl", "tokens": step}}], run_id="r")
        writer.drain()
    """)
    process = subprocess.Popen([sys.executable, "-c", script])
    started = tmp_path / "tables" / "train_steps" / "step=20" / "part-0.parquet"  # the folder comes first
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert process.poll() is None, "the writer finished before the kill"
        os.kill(process.pid, signal.SIGKILL)  # mid-queue: some writes landed, most did not
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    steps = [step for step, _ in fresh_files(tmp_path, "train_steps")]  # step 20's snapshot commit may not have landed
    assert 19 <= len(steps) < total
    assert steps == list(range(1, len(steps) + 1)), f"not a prefix: {steps[:30]}"
    for step, path in fresh_files(tmp_path, "train_steps"):
        assert read_table(tmp_path, "train_steps", step).num_rows == 1, path
    assert strays(tmp_path / "tables") == []  # the killed write's temporary file is its own, and cleaned


def test_a_durable_drain_fsyncs_every_written_file_and_its_folders_before_returning(tmp_path, monkeypatch):
    # what must hold before a checkpoint marks a step done: each partition written since the last
    # durable drain, and every folder from its own up to the run dir, has been fsynced
    import rlpipe.core.files as core_files

    synced: list[Path] = []
    real = core_files.fsync_path
    monkeypatch.setattr(core_files, "fsync_path", lambda path: (synced.append(Path(path)), real(path)))
    run_dir = tmp_path / "run"
    with BackgroundWriter() as writer:
        writer.submit(run_dir, "train_steps", 1, [step_row(1, 0.5)], run_id="r")
        writer.submit(run_dir, "evals", 1, [], run_id="r")
        writer.drain()
        assert synced == []  # a plain drain (a read of one's own writes) costs no fsync
        writer.drain(durable=True)
        tables = run_dir / "tables"
        files = [tables / "train_steps" / "step=1" / "part-0.parquet", tables / "evals" / "step=1" / "part-0.parquet"]
        folders = [f.parent for f in files] + [tables / "train_steps", tables / "evals", tables, run_dir]
        assert set(files + folders) <= set(synced)
        assert max(synced.index(f) for f in files) < min(synced.index(d) for d in folders)
        synced.clear()
        writer.drain(durable=True)
        assert synced == []  # nothing new since: nothing to sync


def test_write_table_durable_fsyncs_the_folders_up_to_the_run_dir(tmp_path, monkeypatch):
    import rlpipe.core.files as core_files
    from rlpipe.storage.writer import write_table

    synced: list[Path] = []
    real = core_files.fsync_path
    monkeypatch.setattr(core_files, "fsync_path", lambda path: (synced.append(Path(path)), real(path)))
    write_table(tmp_path, "train_steps", 4, [step_row(4, 0.1)], run_id="r")
    assert {tmp_path, tmp_path / "tables", tmp_path / "tables" / "train_steps"} <= set(synced)
