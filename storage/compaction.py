"""Compaction: a closed step range's per-step partitions merged into one file, so that a long run
stays fast to query (DuckDB's time follows the number of files, not rows).

    <table>/.../step=<k>/part-0.parquet            fresh: one file per (table, step), storage/layout.py
    <table>/.../steps=<a>-<b>/merged.parquet       compacted: the rows of steps a..b, sorted by step;
                                                   its footer lists the steps it holds (`rlpipe.steps`)

Ranges are aligned (`a` a multiple of `width`, b = a + width - 1) and merged once all of them is
closed: every step of the range is at or before the newest checkpoint, so nothing rewrites it (the
background writer runs a pass after each checkpoint: storage/writer.py `compact_table`).
A step rewritten after its range was merged (the `origins` row a resume rewrites, a `checkpoints`
row a resume completes) is merged again at the next pass. Compaction knows no partition key but
`step`: it merges the `step=<k>` folders that share a parent folder (other hive keys, if a table
has them, sit above `step=`), and writes the merged file beside them. A step split into its
environments' parts (`step=<k>/env=<name>/`, a mixture's rollouts: storage/layout.py) stays fresh:
its files could not be removed at once, and a reader in between would take the step from the
parts left (fresh wins) and miss the others' rows.

Readers never see a row twice or miss one: a fresh file wins over a compacted file for its step.
The pass writes the merged file (atomically, fsynced) before it deletes the fresh files it holds;
until each is deleted, readers take that step's rows from the fresh file (`fresh_wins` in SQL,
`read_table` in Python). A kill at any point leaves fresh files, a compacted file, or both, and
the next pass finishes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rlpipe.storage.layout import PART_NAME, table_dir

COMPACT_STEPS = 100
"""Steps per compacted file: a 10,000-step run keeps ~100 files per table plus the fresh ones."""
STEPS_KEY = b"rlpipe.steps"
RANGE_PREFIX = "steps="
MERGED_NAME = "merged.parquet"  # not part-0.parquet: the views tell the two apart by name


def range_folder(first: int, last: int) -> str:
    """`steps=<first>-<last>`, the folder of a compacted file."""
    return f"{RANGE_PREFIX}{first}-{last}"


def fresh_files(run_dir: str | os.PathLike, table: str) -> list[tuple[int, Path]]:
    """(step, file) of every per-step partition file of `table`, by step: `step=<k>/part-0.parquet`
    at any folder depth, and the environments' parts `step=<k>/env=<name>/part-0.parquet` of a
    mixture's env-partitioned table (several files of one step)."""
    found = []
    for file in table_dir(run_dir, table).glob(f"**/{PART_NAME}"):
        step = _step_of(file)
        if step is not None:
            found.append((step, file))
    return sorted(found)


def _step_of(file: Path) -> int | None:
    """The step of a fresh file: its `step=<k>` folder, or the one above its `env=` folder."""
    folder = file.parent.parent if file.parent.name.startswith("env=") else file.parent
    name = folder.name.removeprefix("step=")
    return int(name) if folder.name.startswith("step=") and name.isdigit() else None


def compacted_files(run_dir: str | os.PathLike, table: str) -> list[Path]:
    """Every compacted file of `table`, by path."""
    return sorted(table_dir(run_dir, table).glob(f"**/{RANGE_PREFIX}*/{MERGED_NAME}"))


def compacted_steps(file: Path) -> list[int]:
    """The steps a compacted file holds (its footer's `rlpipe.steps`)."""
    metadata = pq.read_schema(file).metadata or {}
    return json.loads(metadata.get(STEPS_KEY, b"[]"))


def table_files(run_dir: str | os.PathLike, table: str) -> list[Path]:
    """Every data file of `table`: fresh partitions by step, then compacted files (a reader that
    must not count a step twice takes its fresh file's rows over a compacted copy)."""
    return [file for _, file in fresh_files(run_dir, table)] + compacted_files(run_dir, table)


def stored_steps(run_dir: str | os.PathLike, table: str) -> list[int]:
    """Every step with a partition of `table`, fresh or compacted."""
    steps = {step for step, _ in fresh_files(run_dir, table)}
    for file in compacted_files(run_dir, table):
        steps.update(compacted_steps(file))
    return sorted(steps)


def compacted_step(run_dir: str | os.PathLike, table: str, step: int) -> Path | None:
    """The compacted file that holds `step`, or None."""
    for file in compacted_files(run_dir, table):
        first, _, last = file.parent.name.removeprefix(RANGE_PREFIX).partition("-")
        if int(first) <= step <= int(last) and step in compacted_steps(file):
            return file
    return None


def read_compacted(file: Path, steps: set[int] | None = None, exclude: set[int] = frozenset()) -> pa.Table:
    """A compacted file's rows: of `steps` only (None: all), less those of `exclude`."""
    data = pq.read_table(file, filters=[("step", "in", sorted(steps))] if steps is not None else None)
    keep = None
    if exclude:
        drop = pc.invert(pc.is_in(data.column("step"), pa.array(sorted(exclude), data.schema.field("step").type)))
        keep = drop if keep is None else pc.and_(keep, drop)
    return data if keep is None else data.filter(keep)


def fresh_wins_sql(folder: str, options: str, quote) -> str:
    """A SELECT over one table folder's files (`options`: read_parquet's) that takes each step's
    rows from its fresh file where one exists, else from its compacted file: no row twice while a
    pass deletes the fresh files it merged. Two scans of disjoint files, each matching the zero-row
    `_schema.parquet` so neither glob is ever empty: fresh (`part-0.parquet`) unfiltered, compacted
    (`merged.parquet`) less the steps a fresh file holds (a listing, no file opened)."""
    fresh, merged = quote(f"{folder}/**/[p_]*.parquet"), quote(f"{folder}/**/[m_]*.parquet")
    fresh_steps = (f"SELECT CAST(regexp_extract(file, '/step=([0-9]+)/[^/]*$', 1) AS BIGINT) "
                   f"FROM glob({quote(f'{folder}/**/step=*/{PART_NAME}')})")
    return (f"SELECT * FROM read_parquet([{fresh}], {options}) UNION ALL BY NAME "
            f"SELECT * FROM read_parquet([{merged}], {options}) WHERE step NOT IN ({fresh_steps})")
