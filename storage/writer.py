"""Atomic, idempotent Parquet writes of stage outputs, and plain reads back.

    write_table(run_dir, "scores", step=3, data=rows)   # rows | pa.Table | dict of columns
    is_complete(run_dir, "scores", 3)                   # True: a resumed flow skips the stage
    read_table(run_dir, "scores")                       # every step, as one pa.Table

A (table, step) partition is one zstd Parquet file, replaced atomically: writing the same
(table, step) again replaces it, so a resumed stage never duplicates rows. Data is checked
against the table's schema (storage.schemas; the check is storage.conform) before anything
touches the disk; a mismatch is a ValueError naming the table and the column. `run_id` and
`step` are filled in when missing.

`compact_run` is a compaction pass: closed step ranges merged into one file each
(storage/compaction.py). Readers here read fresh and compacted partitions alike. The same writes
and passes on a background thread: storage/background_writer.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write, clean_leftovers, fsync_path, fsync_written
from rlpipe.storage import catalog
from rlpipe.storage.compaction import (
    COMPACT_STEPS,
    MERGED_NAME,
    STEPS_KEY,
    compacted_files,
    compacted_step,
    compacted_steps,
    fresh_files,
    range_folder,
    read_compacted,
)
from rlpipe.storage.conform import TableData, conform
from rlpipe.storage.layout import (
    CATALOG_NAME,
    ENV_PARTITIONED,
    atomic_write_parquet,
    check_step,
    env_partitioned,
    partition_file,
    step_files,
    table_dir,
)
from rlpipe.storage.schemas import TABLES, schema_for


def default_run_id(run_dir: str | os.PathLike) -> str:
    """The run id used when neither the data nor the caller gives one: the run folder's name."""
    return Path(run_dir).resolve().name


def write_table(
    run_dir: str | os.PathLike,
    table: str,
    step: int,
    data: TableData,
    *,
    run_id: str | None = None,
    durable: bool = True,
) -> Path:
    """Write (or atomically replace) the partition `<run_dir>/tables/<table>/step=<step>/`.

    run_id: defaults to the run_id column of `data`, else the run folder's name.
    durable: fsync the file before the rename and the folders up to run_dir after it, so the
    partition survives a power cut (see core/files.py).
    Returns the partition's file (an env-partitioned table: its first environment's file). An
    empty `data` writes an empty, complete partition.
    """
    return write_files(run_dir, table, step, data, run_id=run_id, durable=durable, prepared=None)[0]


def write_files(run_dir: str | os.PathLike, table: str, step: int, data: TableData, *, run_id: str | None,
                durable: bool, prepared: set[tuple[str, str]] | None) -> list[Path]:
    """write_table, returning every file written; `prepared` remembers the (run_dir, table) pairs
    whose table folder, schema file and catalog this writer already set up, so that a long run
    (storage/background_writer.py) does those once per table."""
    check_step(step)
    if run_id is None:
        run_id = _run_id_of(data) or default_run_id(run_dir)
    arrow = conform(table, data, run_id=run_id, step=step)
    key = (str(run_dir), table)
    first_write = prepared is None or key not in prepared
    if first_write:
        clean_leftovers(table_dir(run_dir, table))
        catalog.ensure_schema_file(run_dir, table)  # before the data: views read columns from it
    written = _write_parts(run_dir, table, step, arrow, durable)
    if durable:
        fsync_written(written, Path(run_dir))
    if first_write:
        if not (Path(run_dir) / CATALOG_NAME).exists():
            catalog.ensure_catalog(run_dir, quiet_if_busy=True)
        if prepared is not None and (Path(run_dir) / CATALOG_NAME).exists():
            prepared.add(key)  # a busy catalog is tried again at the next write
    return written


def _write_parts(run_dir: str | os.PathLike, table: str, step: int, arrow: pa.Table, durable: bool) -> list[Path]:
    """Write a conformed partition: one file, or (an env-partitioned table of a mixture,
    storage/layout.py) one file per environment of its rows, then remove the step's files that
    this write does not name. Returns the files written."""
    flat = partition_file(run_dir, table, step)
    by_env = arrow.num_rows > 0 and env_partitioned(run_dir, table) and arrow.column("env").null_count == 0
    if not by_env:
        clean_leftovers(flat.parent)
        atomic_write_parquet(arrow, flat, durable=durable)
        written = [flat]
    else:
        envs = arrow.column("env")
        written = []
        for env in sorted(set(envs.to_pylist()), key=str):
            dest = partition_file(run_dir, table, step, env=env)
            clean_leftovers(dest.parent)
            atomic_write_parquet(arrow.filter(pc.equal(envs, env)), dest, durable=durable)
            written.append(dest)
    for stale in set(step_files(run_dir, table, step)) | {flat} | set(flat.parent.glob(f"env=*/{flat.name}")):
        if stale not in written:
            stale.unlink(missing_ok=True)
            if stale.parent.name.startswith("env="):
                with contextlib.suppress(OSError):  # a temporary file of a live writer keeps it
                    stale.parent.rmdir()
    return written


def _run_id_of(data: TableData) -> str | None:
    if isinstance(data, pa.Table) and "run_id" in data.column_names and data.num_rows:
        return data.column("run_id")[0].as_py()
    if isinstance(data, Mapping) and "run_id" in data and len(data["run_id"]):
        first = data["run_id"][0]
        return first.as_py() if isinstance(first, pa.Scalar) else first
    if isinstance(data, Sequence) and data and isinstance(data[0], Mapping):
        return data[0].get("run_id")
    return None


def is_complete(run_dir: str | os.PathLike, table: str, step: int) -> bool:
    """Whether the (table, step) partition has been written (partitions appear whole or not at all),
    fresh (one file, or its environments' parts) or merged into a compacted file."""
    return bool(step_files(run_dir, table, step)) or compacted_step(run_dir, table, step) is not None


def read_table(run_dir: str | os.PathLike, table: str, step: int | None = None) -> pa.Table:
    """One partition (FileNotFoundError if absent) or, with step=None, every partition in step order,
    fresh or compacted (a step's fresh file wins over its compacted copy: storage/compaction.py).

    Files written under an older schema are aligned to the current one (new columns null).
    """
    schema = schema_for(table)
    if step is not None:
        files = step_files(run_dir, table, step)
        if files:
            return _in_write_order(table, [align(read_partition(path, table), schema) for path in files])
        if (merged := compacted_step(run_dir, table, step)) is not None:
            return align(read_compacted(merged, steps={step}), schema)
        raise FileNotFoundError(f"table {table!r} has no partition for step {step}: "
                                f"{partition_file(run_dir, table, step)}")
    by_step: dict[int, list[pa.Table]] = {}
    for found, path in fresh_files(run_dir, table):
        by_step.setdefault(found, []).append(align(read_partition(path, table), schema))
    parts = [_in_write_order(table, tables) for _, tables in sorted(by_step.items())]
    fresh_count = len(parts)
    parts += [align(read_compacted(path, exclude=set(by_step)), schema) for path in compacted_files(run_dir, table)]
    if not parts:
        return schema.empty_table()
    data = pa.concat_tables(parts)  # a stable sort: each step's rows keep their order
    return data.take(pc.sort_indices(data, [("step", "ascending")])) if len(parts) > fresh_count else data


def _in_write_order(table: str, parts: list[pa.Table]) -> pa.Table:
    """One step's files as one table; several (a step split by environment) sorted back into
    the order its rows were written in (storage/layout.py `ENV_PARTITIONED`)."""
    if len(parts) == 1:
        return parts[0]
    return pa.concat_tables(parts).sort_by([(column, "ascending") for column in ENV_PARTITIONED[table]])


def read_partition(path: Path, table: str, metadata_only: bool = False) -> Any:
    """One partition file (its metadata only, if asked); a damaged file is a ValueError naming it
    and saying how to recover, instead of a bare Arrow error."""
    try:
        file = pq.ParquetFile(path)
        return file.metadata if metadata_only else file.read()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as error:
        raise ValueError(
            f"table {table!r}: partition file {str(path)!r} is corrupt ({error}). Delete it: "
            "`rlpipe resume` recomputes the stage if its step is after the last checkpoint") from error


def align(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """`data` with `schema`'s columns in order: columns it lacks become null, others are cast."""
    arrays = []
    for field in schema:
        if field.name in data.column_names:
            column = data.column(field.name)
            arrays.append(column if column.type == field.type else column.cast(field.type))
        else:
            arrays.append(pa.nulls(data.num_rows, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def compact_table(run_dir: str | os.PathLike, table: str, closed: int, width: int = COMPACT_STEPS) -> int:
    """Merge `table`'s fresh partitions of every closed range (last step <= `closed`), and of every
    range already compacted, into its range's file; delete the merged fresh files. Returns the
    number of fresh files merged."""
    if width < 1:
        raise ValueError(f"compaction width must be >= 1; got {width}")
    schema_for(table)  # an unknown table fails here
    groups: dict[tuple[Path, int], list[tuple[int, Path]]] = defaultdict(list)
    for step, file in fresh_files(run_dir, table):
        if file.parent.name.startswith("env="):
            continue  # a step split by environment stays fresh (storage/compaction.py)
        groups[(file.parent.parent, step // width)].append((step, file))
    merged = 0
    for (parent, index), files in sorted(groups.items()):
        first, last = index * width, index * width + width - 1
        dest = parent / range_folder(first, last) / MERGED_NAME
        if last > closed and not dest.is_file():
            continue  # still open: a resume may rewrite its steps
        files = [(step, file) for step, file in files if step <= closed]
        if not files:
            continue
        _merge(dest, table, dict(files))
        for _, file in files:  # the merged file is durable: only now do the fresh ones go
            file.unlink()
            try:
                file.parent.rmdir()
            except OSError:
                pass  # a leftover temporary file of a killed writer: clean_leftovers removes it
        fsync_path(parent)
        merged += len(files)
    return merged


_GROUP_ROWS = 65_536  # a compacted file's row groups: this many rows or _GROUP_BYTES, whichever first
_GROUP_BYTES = 64 << 20


def _merge(dest: Path, table: str, fresh: dict[int, Path]) -> None:
    """Write `dest` atomically (fsynced): the steps it already holds less those of `fresh`, and
    the `fresh` files, in step order, whole steps per row group of up to ~_GROUP_ROWS rows or
    _GROUP_BYTES (a reader of one step skips the others by their statistics; memory holds one
    row group, not the range)."""
    schema = schema_for(table)
    held = [step for step in compacted_steps(dest) if step not in fresh] if dest.is_file() else []
    steps = sorted(set(fresh) | set(held))
    schema = schema.with_metadata({**(schema.metadata or {}), STEPS_KEY: json.dumps(steps).encode()})

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as out:
            batch: list[pa.Table] = []
            for step in steps:
                data = read_partition(fresh[step], table) if step in fresh else read_compacted(dest, steps={step})
                batch.append(align(data, schema).replace_schema_metadata(schema.metadata))
                if sum(t.num_rows for t in batch) >= _GROUP_ROWS or sum(t.nbytes for t in batch) >= _GROUP_BYTES:
                    out.write_table(pa.concat_tables(batch), row_group_size=_GROUP_ROWS * 4)
                    batch = []
            if batch:
                out.write_table(pa.concat_tables(batch), row_group_size=_GROUP_ROWS * 4)

    atomic_write(dest, write, durable=True)


def compact_run(run_dir: str | os.PathLike, closed: int, width: int = COMPACT_STEPS) -> dict[str, int]:
    """`compact_table` for every table of the run; {table: fresh files merged} (tables with none left out)."""
    done = {}
    for table in TABLES:
        if table_dir(run_dir, table).is_dir() and (count := compact_table(run_dir, table, closed, width)):
            done[table] = count
    return done
