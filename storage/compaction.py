"""Compaction: a closed step range's per-step partitions merged into one file, so that a long run
stays fast to query (DuckDB's time follows the number of files, not rows); and the readers'
view of a table's files, fresh and compacted, through its snapshot (storage/snapshots.py).

    <table>/.../step=<k>/part-0.parquet              fresh: one file per (table, step), storage/layout.py
    <table>/.../steps=<a>-<b>/merged-<n>.parquet     compacted: the rows of steps a..b, sorted by step;
                                                     its footer lists the steps it holds (`rlpipe.steps`)

Ranges are aligned (`a` a multiple of `width`, b = a + width - 1) and merged once all of them is
closed: every step of the range is at or before the newest checkpoint, so nothing rewrites it (the
background writer runs a pass after each checkpoint: storage/writer.py `compact_table`).
A step rewritten after its range was merged (the `origins` row a resume rewrites, a `checkpoints`
row a resume completes) is merged again at the next pass, into a new file of the range (`<n>`,
the snapshot's version: a file a snapshot names never changes). Compaction knows no partition key
but `step`: it merges the `step=<k>` folders that share a parent folder, and writes the merged
file beside them. A step split into its environments' parts (`step=<k>/env=<name>/`, a mixture's
rollouts: storage/layout.py) stays fresh.

Readers never see a row twice or miss one: they read the files of one snapshot (`table_snapshot`,
`fresh_files`, `compacted_files`, `snapshot_sql`), where a fresh file wins over a merged copy of
its step. A pass commits its merged file to the snapshot and retires the fresh files it holds;
they are deleted a grace period later. A kill at any point leaves the old snapshot or the new.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rlpipe.storage.layout import table_dir
from rlpipe.storage.snapshots import RANGE_PREFIX, STEPS_KEY, TableSnapshot, resolve

COMPACT_STEPS = 100
"""Steps per compacted file: a 10,000-step run keeps ~100 files per table plus the fresh ones."""
MERGED_PREFIX = "merged-"  # merged-<snapshot version>.parquet: a range merged again gets a new file


def range_folder(first: int, last: int) -> str:
    """`steps=<first>-<last>`, the folder of a compacted file."""
    return f"{RANGE_PREFIX}{first}-{last}"


def table_snapshot(run_dir: str | os.PathLike, table: str) -> TableSnapshot:
    """The table's snapshot now (storage/snapshots.py): what every reader reads."""
    return resolve(table_dir(run_dir, table))


def fresh_files(run_dir: str | os.PathLike, table: str, snapshot: TableSnapshot | None = None) -> list[tuple[int, Path]]:
    """(step, file) of every per-step partition file of `table` in its snapshot, by step:
    `step=<k>/part-0.parquet`, or the environments' parts `step=<k>/env=<name>/part-0.parquet`
    of a mixture's env-partitioned table (several files of one step)."""
    snapshot = table_snapshot(run_dir, table) if snapshot is None else snapshot
    folder = table_dir(run_dir, table)
    return sorted((step, folder / path) for step, paths in snapshot.fresh.items() for path in paths)


def compacted_files(run_dir: str | os.PathLike, table: str, snapshot: TableSnapshot | None = None) -> list[Path]:
    """Every compacted file of `table` in its snapshot, by path."""
    snapshot = table_snapshot(run_dir, table) if snapshot is None else snapshot
    return sorted(table_dir(run_dir, table) / path for path in snapshot.merged)


def compacted_steps(file: Path) -> list[int]:
    """The steps a compacted file holds (its footer's `rlpipe.steps`)."""
    metadata = pq.read_schema(file).metadata or {}
    return json.loads(metadata.get(STEPS_KEY, b"[]"))


def table_files(run_dir: str | os.PathLike, table: str) -> list[Path]:
    """Every data file of `table`'s snapshot: fresh partitions by step, then compacted files (a
    reader that must not count a step twice takes its fresh file's rows over a compacted copy)."""
    snapshot = table_snapshot(run_dir, table)
    return [file for _, file in fresh_files(run_dir, table, snapshot)] + compacted_files(run_dir, table, snapshot)


def stored_steps(run_dir: str | os.PathLike, table: str) -> list[int]:
    """Every step with a partition of `table`, fresh or compacted."""
    return table_snapshot(run_dir, table).steps()


def compacted_step(run_dir: str | os.PathLike, table: str, step: int,
                   snapshot: TableSnapshot | None = None) -> Path | None:
    """The compacted file that holds `step`, or None."""
    snapshot = table_snapshot(run_dir, table) if snapshot is None else snapshot
    for path, steps in sorted(snapshot.merged.items()):
        if step in steps:
            return table_dir(run_dir, table) / path
    return None


def read_compacted(file: Path, steps: set[int] | None = None, exclude: set[int] = frozenset()) -> pa.Table:
    """A compacted file's rows: of `steps` only (None: all), less those of `exclude`."""
    data = pq.read_table(file, filters=[("step", "in", sorted(steps))] if steps is not None else None)
    if not exclude:
        return data
    drop = pc.invert(pc.is_in(data.column("step"), pa.array(sorted(exclude), data.schema.field("step").type)))
    return data.filter(drop)


def snapshot_sql(schema_file: Path | None, fresh: list[Path], merged: list[Path], shadowed: set[int],
                 options: str, quote) -> str | None:
    """A SELECT over exactly the files of one table snapshot (`options`: read_parquet's): the
    fresh files, and the merged files less the steps a fresh file holds (`shadowed`); None when
    there is nothing to scan. The zero-row schema file, where there is one, comes first in each
    scan: it gives the current columns and keeps a scan of no data file valid."""
    head = [] if schema_file is None else [schema_file]

    def scan(files: list[Path]) -> str:
        return f"read_parquet([{', '.join(quote(str(f)) for f in [*head, *files])}], {options})"

    where = f" WHERE step NOT IN ({', '.join(map(str, sorted(shadowed)))})" if shadowed else ""
    selects = [f"SELECT * FROM {scan(fresh)}"] if fresh or head else []
    selects += [f"SELECT * FROM {scan(merged)}{where}"] if merged else []
    return " UNION ALL BY NAME ".join(selects) or None
