"""The stages' persistence: each stage's tables written, and read back on resume (one path).

Tables first: they are the source of truth; MLflow mirrors them for dashboards and the registry.

A stage is a function decorated with `stage(name, tables=...)`: calling it runs the function
through the current stage runner (core/stage_runs.py: a plain call, or a Prefect task run inside a
flow) with its tables around it. It declares the tables it writes (`StageTable`), and
`run_with_tables` does the rest around the stage function: when a table says how to read the
stage's result back and the step's partition holds it (a resumed step), that is the result and
the function does not run; otherwise the function runs and each table's rows of its result are
written to tables/<table>/step=<step>/ (atomically, storage/writer.py). The stage's `run_dir`,
`run_id` and `step` arguments say where.

Inside `background_writes()` (the RL flow's loop), `persist` queues each write on one ordered
writer thread instead of waiting for it (a write is 3-5 ms, six a step); reads of a partition
with a queued write wait for the queue, and `drain_writes()` must run before anything marks
progress as durable (a checkpoint). Outside the block, `persist` writes synchronously.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.core.stage_runs import run_stage
from rlpipe.core.termination import raise_if_terminated
from rlpipe.storage.background_writer import BackgroundWriter
from rlpipe.storage.writer import (
    is_complete,
    read_partition,
    read_table,
    step_files,
    write_table,
)

# the writer of the enclosing `background_writes()` block; a ContextVar, not a global, so each
# flow (thread, context) sees only its own. Prefect runs sync task runs in the caller's context.
_WRITER: ContextVar[BackgroundWriter | None] = ContextVar("rlpipe_background_writer", default=None)


@contextmanager
def background_writes() -> Iterator[BackgroundWriter]:
    """Queue `persist` writes on one background thread while the block runs; leaving the block
    drains the queue (also on an exception, so the tables of finished stages land on disk)."""
    writer = BackgroundWriter()
    token = _WRITER.set(writer)
    try:
        with writer:
            yield writer
    finally:
        _WRITER.reset(token)


def drain_writes() -> None:
    """Wait until every queued table write is on disk, fsynced with its folders (a checkpoint
    comes next and marks the step done); raises storage.background_writer.TableWriteError
    naming the (table, step) of a failed write. A no-op outside `background_writes()`."""
    writer = _WRITER.get()
    if writer is not None:
        writer.drain(durable=True)


def compact_closed_steps(run_dir: Path, closed: int) -> None:
    """Queue a compaction pass over the run's steps <= `closed` (storage/compaction.py) on the
    background writer, after the writes queued before it; a no-op outside `background_writes()`."""
    writer = _WRITER.get()
    if writer is not None:
        writer.compact(run_dir, closed)


def _settle(run_dir: Path, table: str, step: int) -> None:
    """Reads see this process's own writes: wait when the partition has one queued."""
    writer = _WRITER.get()
    if writer is not None and writer.has_pending(run_dir, table, step):
        writer.drain()


def persist_now(run_dir: Path, table: str, step: int, rows: list[dict], run_id: str) -> None:
    """Write a table partition synchronously and durably (fsynced), after every queued write:
    for rows that must be on disk when the call returns (after a checkpoint)."""
    drain_writes()
    write_table(run_dir, table, step, rows, run_id=run_id, durable=True)


def persist(run_dir: Path, table: str, step: int, rows: list[dict], run_id: str, durable: bool = False) -> None:
    """Write a stage's table atomically (temporary file + rename: a crashed or killed process
    never leaves a partial partition). Per-step tables skip fsync by default: it guards only
    against power or OS failure (where the newest partitions may then be missing) and costs
    ~7 ms a write, 9% of a demo-sized RL step. Checkpoints are always fsynced.

    Inside `background_writes()` the write is queued (FIFO) and this returns at once; an earlier
    queued write that failed raises here."""
    writer = _WRITER.get()
    if writer is not None:
        writer.submit(run_dir, table, step, rows, run_id=run_id, durable=durable)
    else:
        write_table(run_dir, table, step, rows, run_id=run_id, durable=durable)


def load_rows(run_dir: Path, table: str, step: int) -> list[dict] | None:
    """The rows of a complete (table, step) partition, or None when it was never written."""
    _settle(run_dir, table, step)
    if not is_complete(run_dir, table, step):
        return None
    return read_table(run_dir, table, step).to_pylist()


def stored_row(run_dir: Path, table: str, step: int) -> dict | None:
    """The first row of a complete (table, step) partition, or None (never written, or empty)."""
    rows = load_rows(run_dir, table, step)
    return rows[0] if rows else None


def load_rows_beyond(run_dir: Path, table: str, step: int, known: int) -> list[dict] | None:
    """The rows of a (table, step) partition when it holds more than the `known` rows this
    process wrote itself (a resumed step); None otherwise, without reading past the footer."""
    _settle(run_dir, table, step)
    files = step_files(run_dir, table, step)
    if not files or sum(read_partition(path, table, metadata_only=True).num_rows for path in files) <= known:
        return None
    return read_table(run_dir, table, step).to_pylist()


def _never(arguments: Mapping[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class StageTable:
    """A table a stage writes, one partition per step (the stage's `step` argument).

    Each callable gets the stage's arguments by name (defaults applied) as `arguments`."""

    name: str
    rows: Callable[[Any, Mapping[str, Any]], list[dict] | None]
    """rows(result, arguments): the partition's rows for the stage's result; None writes nothing."""
    read_back: Callable[[list[dict], Mapping[str, Any]], Any] | None = None
    """read_back(stored rows, arguments): the stage's result from a stored partition (a resumed
    step), or None when it does not hold it; unset: the stage always runs."""
    known: Callable[[Mapping[str, Any]], int] | None = None
    """For a partition that grows by rounds: how many of its rows this process wrote itself
    (earlier rounds); it is read back only when it holds more. Unset: read when complete."""
    durable: bool = False
    """Write synchronously and fsynced, after every queued write (rows that must be on disk when
    the stage returns)."""
    keep_stored: Callable[[Mapping[str, Any]], bool] = _never
    """keep_stored(arguments): a stored partition is kept as it is rather than rewritten."""
    first: bool = False
    """Written before the stage function runs, from its arguments (`rows(None, arguments)`):
    rows that must reach the table before what the stage does (a step's row before the
    checkpoint that marks the step done)."""


def stage_arguments(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of `fn` by parameter name, defaults applied, **kwargs flattened."""
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out |= out.pop(name, {})
    return out


def stored_result(table: StageTable, arguments: Mapping[str, Any]) -> Any | None:
    """The stage's result read back from its stored partition, or None (run the stage)."""
    if table.read_back is None:
        return None
    run_dir, step = arguments["run_dir"], arguments["step"]
    if table.known is None:
        stored = load_rows(run_dir, table.name, step)
    else:
        stored = load_rows_beyond(run_dir, table.name, step, known=table.known(arguments))
    return None if stored is None else table.read_back(stored, arguments)


def write_stage_table(table: StageTable, result: Any, arguments: Mapping[str, Any]) -> None:
    """Write the table's rows of a stage's result (or nothing: rows None, or a kept partition)."""
    rows = table.rows(result, arguments)
    if rows is None:
        return
    run_dir, run_id, step = arguments["run_dir"], arguments["run_id"], arguments["step"]
    if table.keep_stored(arguments) and load_rows(run_dir, table.name, step) is not None:
        return
    if table.durable:
        persist_now(run_dir, table.name, step, rows, run_id)
    else:
        persist(run_dir, table.name, step, rows, run_id)


def run_with_tables(fn: Callable, tables: tuple[StageTable, ...], check: Callable[[Any], None] | None,
                    /, *args: Any, **kwargs: Any) -> Any:
    """Call a stage with its tables: a result stored by an earlier run of the step is read back
    instead of recomputed; else the `first` tables are written, `fn` runs, the other tables'
    rows of its result are written in the declared order, then `check(result)` may raise."""
    arguments = stage_arguments(fn, args, kwargs)
    for table in tables:
        stored = stored_result(table, arguments)
        if stored is not None:
            return stored
    for table in tables:
        if table.first:
            write_stage_table(table, None, arguments)
    result = fn(*args, **kwargs)
    for table in tables:
        if not table.first:
            write_stage_table(table, result, arguments)
    if check is not None:
        check(result)
    return result


def stage(name: str, retries: int = 0, retry_delay_seconds: float = 1.0, *,
          tables: tuple[StageTable, ...] = (), check: Callable[[Any], None] | None = None,
          works: Callable[[Mapping[str, Any]], bool] | None = None) -> Callable[[Callable], Any]:
    """Decorate a stage function: calling it runs the stage `name` through the current runner
    (core/stage_runs.py `run_stage`: a Prefect task run in a flow, else a plain call with the
    same retries) that writes `tables` (read back instead of recomputed on resume;
    `run_with_tables`), then runs `check(result)`, which may raise.

    works(keyword arguments): whether this call does the stage's work; a call that does not (a
    step whose checkpoint is not due) is a plain call with its tables, never a task run of its own.

    The plain function, without tables, stays available as `.fn`.
    """

    def decorate(fn: Callable) -> Callable:
        def with_tables(*args: Any, **kwargs: Any) -> Any:
            return run_with_tables(fn, tables, check, *args, **kwargs)

        body = functools.wraps(fn)(with_tables) if tables or check is not None else fn

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            raise_if_terminated()  # a SIGTERM whose exception was swallowed stops the run here
            if works is not None and not works(kwargs):
                return body(*args, **kwargs)
            return run_stage(name, body, args, kwargs, retries=retries, retry_delay_s=retry_delay_seconds)

        run.fn = fn
        return run

    return decorate
