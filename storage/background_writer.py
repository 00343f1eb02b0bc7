"""`BackgroundWriter`: storage/writer.py's `write_table` on one background thread, so that a step
does not wait for its tables, and compaction passes (`compact_run`) queued behind the writes.

    with BackgroundWriter() as writer:
        writer.submit(run_dir, "scores", 3, rows)   # returns at once
        writer.compact(run_dir, closed=9)           # after the writes queued before it
        writer.drain(durable=True)                  # every submitted write is on disk, fsynced

See the class docstring for the crash and error contract (`TableWriteError`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from rlpipe.core.files import fsync_written
from rlpipe.storage.catalog import ensure_catalog
from rlpipe.storage.compaction import COMPACT_STEPS
from rlpipe.storage.conform import TableData
from rlpipe.storage.layout import check_step
from rlpipe.storage.schemas import schema_for
from rlpipe.storage.writer import compact_run, write_files


class TableWriteError(RuntimeError):
    """A background write that failed; names the (table, step) and chains the original error."""

    def __init__(self, table: str, step: int, error: BaseException, skipped: int = 0) -> None:
        later = f"; {skipped} later write(s) were not attempted" if skipped else ""
        super().__init__(f"table {table!r} step {step}: background write failed: "
                         f"{type(error).__name__}: {error}{later}")
        self.table, self.step = table, step


@dataclass(frozen=True)
class _Job:
    run_dir: str | os.PathLike
    table: str
    step: int
    data: TableData
    run_id: str | None
    durable: bool
    compact_width: int = 0
    """> 0: not a write but a compaction pass over the run's steps <= `step` (`compact_run`)."""


_COMPACTION = "*compaction*"  # the table name of a compaction job's key
CATALOG_REFRESH_SECONDS = 1.0
"""How often, at most, the writer rebuilds a run's catalog.duckdb while it writes (when its queue
runs empty); it always does after a compaction pass and when drained durably or closed."""


class BackgroundWriter:
    """`write_table` on one background thread, first in first out.

        with BackgroundWriter() as writer:
            writer.submit(run_dir, "scores", 3, rows)   # returns at once
            writer.drain()                              # every submitted write is on disk

    Writes happen in submission order, each atomic, so a killed process has written a prefix of
    its submissions: the same disk state as a process killed earlier, with nothing partial.
    Callers that make progress durable elsewhere (a checkpoint) call `drain(durable=True)` first:
    it also fsyncs every file written since the last durable drain, and their folders up to the
    run directory, so a checkpoint never outlives, even after a power cut, the partitions it
    depends on (one fsync batch per checkpoint instead of ~7 ms per write). `submit` snapshots
    row lists (a shallow copy of each row) so later changes by the caller cannot leak into the
    table. The first failure stops the writer — later writes are dropped, so the disk still
    holds a prefix — and raises TableWriteError at every later `submit`, `drain` and `close`.
    """

    def __init__(self, name: str = "rlpipe-table-writer") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._error: TableWriteError | None = None
        self._closed = False
        self._prepared: set[tuple[str, str]] = set()
        self._keys: dict[tuple[str, str, int], int] = {}  # (run_dir, table, step) -> queued writes
        self._unsynced: dict[str, list[Path]] = {}  # run_dir -> files written without fsync
        self._stale: set[str] = set()  # runs written since their catalog.duckdb was rebuilt
        self._rebuilt: dict[str, float] = {}  # run_dir -> when its catalog.duckdb was last rebuilt
        self.busy_seconds = 0.0  # time spent writing, for benchmarks
        self.compacted = 0  # fresh partition files merged by compaction passes
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, run_dir: str | os.PathLike, table: str, step: int, data: TableData, *,
               run_id: str | None = None, durable: bool = False) -> None:
        """Queue a write of (table, step); raises the error of an earlier failed write."""
        if self._closed:
            raise RuntimeError(f"BackgroundWriter is closed: cannot write table {table!r} step {step}")
        check_step(step)
        schema_for(table)  # an unknown table fails here, at the caller
        self._raise_error()
        job = _Job(run_dir, table, step, _snapshot(data), run_id, durable)
        key = _key(run_dir, table, step)
        with self._done:
            self._submitted += 1
            self._keys[key] = self._keys.get(key, 0) + 1
        self._jobs.put(job)

    def pending(self) -> int:
        """Writes submitted and not yet finished (or dropped)."""
        with self._done:
            return self._submitted - self._finished

    def compact(self, run_dir: str | os.PathLike, closed: int, width: int = COMPACT_STEPS) -> None:
        """Queue a compaction pass (`compact_run`) over the run's steps <= `closed`, which nothing
        rewrites any more (a checkpoint marks them done); it runs after the writes queued before it."""
        if self._closed:
            raise RuntimeError(f"BackgroundWriter is closed: cannot compact {run_dir}")
        self._raise_error()
        key = _key(run_dir, _COMPACTION, check_step(closed))
        with self._done:
            self._submitted += 1
            self._keys[key] = self._keys.get(key, 0) + 1
        self._jobs.put(_Job(run_dir, _COMPACTION, closed, None, None, True, width))

    def has_pending(self, run_dir: str | os.PathLike, table: str, step: int) -> bool:
        """Whether a write of this (table, step) is queued or running, or a compaction of the run
        (which moves partitions between files)."""
        folder = os.path.abspath(run_dir)
        with self._done:
            return self._keys.get(_key(run_dir, table, step), 0) > 0 or any(
                key[0] == folder and key[1] == _COMPACTION and step <= key[2] for key in self._keys)

    def drain(self, durable: bool = False) -> None:
        """Wait until every submitted write is on disk; raise TableWriteError if one failed.
        durable: then fsync what was written since the last durable drain (files and folders)."""
        with self._done:
            self._done.wait_for(lambda: self._finished >= self._submitted)
            unsynced, self._unsynced = (self._unsynced, {}) if durable else ({}, self._unsynced)
        self._raise_error()
        for run_dir, files in unsynced.items():
            fsync_written(files, Path(run_dir))
        if durable:
            self._refresh_catalogs(force=True)

    def _refresh_catalogs(self, force: bool) -> None:
        """Rebuild the catalog.duckdb of each run written since its last rebuild (storage/catalog.py:
        its views name the files of the tables' snapshots), at most every CATALOG_REFRESH_SECONDS
        unless `force`."""
        with self._done:
            clock = time.monotonic()
            due = [run for run in self._stale if force or clock - self._rebuilt.get(run, -1e9) >= CATALOG_REFRESH_SECONDS]
            self._stale.difference_update(due)
            self._rebuilt.update({run: clock for run in due})
        for run in due:
            try:
                ensure_catalog(run, quiet_if_busy=True)
            except Exception as error:  # noqa: BLE001 - a derived file: the tables are written
                warnings.warn(f"catalog of {run} not rebuilt: {type(error).__name__}: {error}", stacklevel=2)

    def close(self, raise_errors: bool = True) -> None:
        """Drain, then stop the thread. raise_errors=False: keep a write error quiet (the caller
        is already propagating another exception)."""
        if self._closed:
            return
        try:
            self.drain(durable=True)
        except TableWriteError:
            pass  # raised below (or kept quiet) with the thread stopped
        finally:
            self._closed = True
            self._jobs.put(None)
            self._thread.join()
        if raise_errors:
            self._raise_error()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_errors=exc_type is None)

    def _raise_error(self) -> None:
        with self._done:
            error = self._error
        if error is not None:  # sticky: a stopped writer refuses every later write
            raise error

    def _run(self) -> None:
        failed = False
        while (job := self._jobs.get()) is not None:
            start = time.perf_counter()
            skipped = 0
            if not failed:
                try:
                    if job.compact_width:
                        self.compacted += sum(compact_run(job.run_dir, job.step, job.compact_width).values())
                        written = []
                        with self._done:  # merged files are fsynced; the fresh ones they replace are gone
                            run = str(job.run_dir)
                            self._unsynced[run] = [f for f in self._unsynced.get(run, []) if f.exists()]
                    else:
                        written = write_files(job.run_dir, job.table, job.step, job.data, run_id=job.run_id,
                                              durable=job.durable, prepared=self._prepared)
                    if not job.durable:
                        with self._done:
                            self._unsynced.setdefault(str(job.run_dir), []).extend(written)
                    with self._done:
                        self._stale.add(str(job.run_dir))
                        if job.compact_width:  # a pass's new files: its catalog is rebuilt at once
                            self._rebuilt.pop(str(job.run_dir), None)
                    if self._jobs.empty():
                        self._refresh_catalogs(force=False)
                except BaseException as error:  # noqa: BLE001 - surfaced at the next submit/drain
                    failed = True
                    skipped = self._jobs.qsize()
                    wrapped = TableWriteError(job.table, job.step, error, skipped)
                    wrapped.__cause__ = error
                    with self._done:
                        self._error = wrapped
            self.busy_seconds += time.perf_counter() - start
            key = _key(job.run_dir, job.table, job.step)
            with self._done:
                self._finished += 1
                self._keys[key] -= 1
                if not self._keys[key]:
                    del self._keys[key]
                self._done.notify_all()


def _key(run_dir: str | os.PathLike, table: str, step: int) -> tuple[str, str, int]:
    return (os.path.abspath(run_dir), table, step)


def _snapshot(data: TableData) -> TableData:
    """`data` safe from later changes by the caller: Arrow tables are immutable; row lists and
    column dicts are copied one level deep."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, Mapping):
        return {name: list(values) if isinstance(values, list) else values for name, values in data.items()}
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return [dict(row) if isinstance(row, Mapping) else row for row in data]
    return data
