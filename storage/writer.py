"""Atomic, idempotent Parquet writes of stage outputs, and plain reads back.

    write_table(run_dir, "scores", step=3, data=rows)   # rows | pa.Table | dict of columns
    is_complete(run_dir, "scores", 3)                   # True: a resumed flow skips the stage
    read_table(run_dir, "scores")                       # every step, as one pa.Table

A (table, step) partition is one zstd Parquet file, replaced atomically, then named in the table's
snapshot (storage/snapshots.py: the one file every reader resolves): writing the same (table,
step) again replaces it, so a resumed stage never duplicates rows. Data is checked
against the table's schema (storage.schemas; the check is storage.conform) before anything
touches the disk; a mismatch is a ValueError naming the table and the column. `run_id` and
`step` are filled in when missing.

`compact_run` is a compaction pass: closed step ranges merged into one file each
(storage/compaction.py). Readers here read fresh and compacted partitions alike, each call as of
one snapshot of the table. The same writes
and passes on a background thread: storage/background_writer.py.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write, clean_leftovers, fsync_written
from rlpipe.storage import catalog
from rlpipe.storage.compaction import (
    COMPACT_STEPS,
    MERGED_PREFIX,
    compacted_files,
    compacted_step,
    fresh_files,
    range_folder,
    read_compacted,
    table_snapshot,
)
from rlpipe.storage.conform import TableData, conform
from rlpipe.storage.layout import (
    CATALOG_NAME,
    ENV_PARTITIONED,
    atomic_write_parquet,
    check_step,
    env_partitioned,
    partition_file,
    table_dir,
)
from rlpipe.storage.schemas import TABLES, schema_for
from rlpipe.storage.snapshots import (
    RETIRED_GRACE_SECONDS,
    STEPS_KEY,
    commit,
    locked,
    now,
    resolve,
    swept,
    with_merge,
    with_step,
)


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
    storage/layout.py) one file per environment of its rows, then commit the table's snapshot
    with the step's files (storage/snapshots.py: the step's earlier files it does not name are
    retired, deleted by a later pass). Returns the files written, the snapshot file last."""
    flat = partition_file(run_dir, table, step)
    by_env = arrow.num_rows > 0 and env_partitioned(run_dir, table) and arrow.column("env").null_count == 0
    parts = [(flat, arrow)]
    if by_env:
        envs = arrow.column("env")
        parts = [(partition_file(run_dir, table, step, env=env), arrow.filter(pc.equal(envs, env)))
                 for env in sorted(set(envs.to_pylist()), key=str)]
    folder = table_dir(run_dir, table)
    with locked(folder):  # the files and the snapshot naming them, as one change
        for dest, rows in parts:
            clean_leftovers(dest.parent)
            atomic_write_parquet(rows, dest, durable=durable)
        names = [dest.relative_to(folder).as_posix() for dest, _ in parts]
        snapshot = commit(folder, lambda current: with_step(current, step, names, now()), durable=durable)
    return [dest for dest, _ in parts] + [snapshot]


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
    """Whether the table's snapshot holds the (table, step) partition (partitions appear whole or
    not at all), fresh (one file, or its environments' parts) or merged into a compacted file. A
    fresh file deleted by hand (a corrupt one, as `read_partition` says) makes its step absent."""
    snapshot = table_snapshot(run_dir, table)
    files = [file for found, file in fresh_files(run_dir, table, snapshot) if found == step]
    return all(file.is_file() for file in files) if files else compacted_step(run_dir, table, step, snapshot) is not None


def step_files(run_dir: str | os.PathLike, table: str, step: int) -> list[Path]:
    """The fresh files of one (table, step) partition in the table's snapshot (none: absent, or
    only in a compacted file, or a file of it deleted by hand)."""
    files = [file for found, file in fresh_files(run_dir, table) if found == step]
    return files if all(file.is_file() for file in files) else []


def read_table(run_dir: str | os.PathLike, table: str, step: int | None = None,
               as_of_step: int | None = None) -> pa.Table:
    """One partition (FileNotFoundError if absent) or, with step=None, every partition in step order
    (through `as_of_step` when given), fresh or compacted, as of one snapshot of the table (a
    step's fresh file wins over its compacted copy: storage/compaction.py).

    Files written under an older schema are aligned to the current one (new columns null).
    """
    schema = schema_for(table)
    snapshot = table_snapshot(run_dir, table)
    if step is not None:
        files = [file for found, file in fresh_files(run_dir, table, snapshot) if found == step]
        if files:
            return _in_write_order(table, [align(read_partition(path, table), schema) for path in files])
        if (merged := compacted_step(run_dir, table, step, snapshot)) is not None:
            return align(read_compacted(merged, steps={step}), schema)
        raise FileNotFoundError(f"table {table!r} has no partition for step {step}: "
                                f"{partition_file(run_dir, table, step)}")
    last = float("inf") if as_of_step is None else as_of_step
    by_step: dict[int, list[pa.Table]] = {}
    for found, path in fresh_files(run_dir, table, snapshot):
        if found <= last:
            by_step.setdefault(found, []).append(align(read_partition(path, table), schema))
    parts = [_in_write_order(table, tables) for _, tables in sorted(by_step.items())]
    fresh_count = len(parts)
    skip = set(snapshot.fresh) | {s for held in snapshot.merged.values() for s in held if s > last}
    parts += [align(read_compacted(path, exclude=skip), schema) for path in compacted_files(run_dir, table, snapshot)]
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


def compact_table(run_dir: str | os.PathLike, table: str, closed: int, width: int = COMPACT_STEPS,
                  grace: float = RETIRED_GRACE_SECONDS) -> int:
    """Merge `table`'s fresh partitions of every closed range (last step <= `closed`), and of every
    range already compacted, into a new file of its range, each merge one snapshot commit (the
    merged fresh files and the range's earlier file retired); then delete the files retired at
    least `grace` seconds ago (storage/snapshots.py). Returns the number of fresh files merged."""
    if width < 1:
        raise ValueError(f"compaction width must be >= 1; got {width}")
    schema_for(table)  # an unknown table fails here
    folder = table_dir(run_dir, table)
    merged = 0
    with locked(folder):  # no write of this table lands between a merge's read and its commit
        snapshot = table_snapshot(run_dir, table)
        groups: dict[tuple[Path, int], list[tuple[int, Path]]] = defaultdict(list)
        for step, file in fresh_files(run_dir, table, snapshot):
            if file.parent.name.startswith("env="):
                continue  # a step split by environment stays fresh (storage/compaction.py)
            groups[(file.parent.parent, step // width)].append((step, file))
        for (parent, index), files in sorted(groups.items()):
            first, last = index * width, index * width + width - 1
            earlier = _range_file(snapshot.merged, parent.relative_to(folder) / range_folder(first, last))
            if last > closed and earlier is None:
                continue  # still open: a resume may rewrite its steps
            files = [(step, file) for step, file in files if step <= closed]
            if not files:
                continue
            name = (parent / range_folder(first, last)).relative_to(folder) / f"{MERGED_PREFIX}{snapshot.version + 1}.parquet"
            held = () if earlier is None else snapshot.merged[earlier]
            steps = _merge(folder / name, table, dict(files), None if earlier is None else (folder / earlier, held))
            commit(folder, _merge_change(name.as_posix(), steps, earlier, [step for step, _ in files]), durable=True)
            snapshot = table_snapshot(run_dir, table)
            merged += len(files)
        _sweep(folder, grace)
    return merged


def _merge_change(merged: str, steps: list[int], earlier: str | None, fresh: list[int]):
    """The snapshot change that puts one range's merged file in (storage/snapshots.py with_merge)."""
    return lambda current: with_merge(current, merged, steps, earlier, fresh, now())


def _range_file(merged: dict, folder: Path) -> str | None:
    """The snapshot's merged file of the range folder `folder` (relative to the table's), or None."""
    found = [path for path in merged if Path(path).parent == folder]
    return found[0] if found else None


def _sweep(folder: Path, grace: float) -> None:
    """Delete the table's files retired at least `grace` seconds ago, once a snapshot without
    them is committed; their emptied folders too (a kill in between leaves files no snapshot
    names, which nothing reads)."""
    gone: list[str] = []

    def change(current):
        kept, due = swept(current, now(), grace)
        gone.extend(due)
        return kept

    if not resolve(folder).retired:
        return
    commit(folder, change, durable=True)
    for path in gone:
        (folder / path).unlink(missing_ok=True)
        for parent in (folder / path).parents:
            if parent == folder:
                break
            try:
                parent.rmdir()
            except OSError:
                break  # not empty (a leftover temporary file, another environment's part)


_GROUP_ROWS = 65_536  # a compacted file's row groups: this many rows or _GROUP_BYTES, whichever first
_GROUP_BYTES = 64 << 20


def _merge(dest: Path, table: str, fresh: dict[int, Path], earlier: tuple[Path, tuple[int, ...]] | None) -> list[int]:
    """Write `dest` atomically (fsynced): the steps the range's `earlier` merged file holds less
    those of `fresh`, and the `fresh` files, in step order, whole steps per row group of up to
    ~_GROUP_ROWS rows or _GROUP_BYTES (a reader of one step skips the others by their statistics;
    memory holds one row group, not the range). Returns the steps it holds."""
    schema = schema_for(table)
    held = [step for step in earlier[1] if step not in fresh] if earlier is not None else []
    steps = sorted(set(fresh) | set(held))
    schema = schema.with_metadata({**(schema.metadata or {}), STEPS_KEY: json.dumps(steps).encode()})

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as out:
            batch: list[pa.Table] = []
            for step in steps:
                data = read_partition(fresh[step], table) if step in fresh else read_compacted(earlier[0], steps={step})
                batch.append(align(data, schema).replace_schema_metadata(schema.metadata))
                if sum(t.num_rows for t in batch) >= _GROUP_ROWS or sum(t.nbytes for t in batch) >= _GROUP_BYTES:
                    out.write_table(pa.concat_tables(batch), row_group_size=_GROUP_ROWS * 4)
                    batch = []
            if batch:
                out.write_table(pa.concat_tables(batch), row_group_size=_GROUP_ROWS * 4)

    atomic_write(dest, write, durable=True)
    return steps


def compact_run(run_dir: str | os.PathLike, closed: int, width: int = COMPACT_STEPS,
                grace: float = RETIRED_GRACE_SECONDS) -> dict[str, int]:
    """`compact_table` for every table of the run; {table: fresh files merged} (tables with none left out)."""
    done = {}
    for table in TABLES:
        if table_dir(run_dir, table).is_dir() and (count := compact_table(run_dir, table, closed, width, grace)):
            done[table] = count
    return done
