"""Where a run's tables live on disk, and how a partition is written atomically.

    <run_dir>/tables/<table>/step=<k>/part-0.parquet   one file per (table, step) partition
    <run_dir>/tables/<table>/steps=<a>-<b>/merged.parquet   closed steps a..b compacted (storage/compaction.py)
    <run_dir>/tables/<table>/_schema.parquet           zero rows: the table's current schema
    <run_dir>/catalog.duckdb                           DuckDB views over the above

A partition is a single file replaced atomically (core/files.py), so a reader — or a writer
killed with SIGKILL — only ever sees the old file or the new one; temporary files are hidden and
do not end in `.parquet`, so no reader glob matches them.
The zero-row `_schema.parquet` keeps catalog views valid before any data exists (DuckDB refuses a
glob that matches no file) and gives every view the newest column set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write
from rlpipe.storage.schemas import schema_for

PART_NAME = "part-0.parquet"
SCHEMA_NAME = "_schema.parquet"
CATALOG_NAME = "catalog.duckdb"


def tables_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "tables"


def table_dir(run_dir: str | os.PathLike, table: str) -> Path:
    schema_for(table)  # validates the name
    return tables_root(run_dir) / table


def partition_file(run_dir: str | os.PathLike, table: str, step: int) -> Path:
    """Path of the single Parquet file of one (table, step) partition."""
    return table_dir(run_dir, table) / f"step={check_step(step)}" / PART_NAME


def schema_file(run_dir: str | os.PathLike, table: str) -> Path:
    return table_dir(run_dir, table) / SCHEMA_NAME


def partition_files(run_dir: str | os.PathLike, table: str) -> list[tuple[int, Path]]:
    """(step, file) of every complete partition of `table`, ordered by step."""
    root = table_dir(run_dir, table)
    found = []
    for folder in root.glob("step=*"):
        file = folder / PART_NAME
        try:
            step = int(folder.name.removeprefix("step="))
        except ValueError:
            continue
        if file.is_file():
            found.append((step, file))
    return sorted(found)


def relocated(path: str, run_dir: str | os.PathLike) -> str:
    """`path`, recorded by a run (its own or a sibling pipeline phase's checkpoint), where it lies
    now if the run folder was moved or copied since: run.json's `run_dir` is the folder the run was
    last opened at; a path under it (a pipeline phase's: under the pipeline folder above it) maps
    to the same place under the folder given, when that exists. Otherwise `path` unchanged."""
    run_dir = Path(run_dir).resolve()
    try:
        state = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return path
    recorded = state.get("run_dir")
    if not recorded or Path(recorded) == run_dir:
        return path
    nested = "/" in str(state.get("run_id", ""))  # a pipeline phase: `<name>/<phase>`
    old_base, new_base = (Path(recorded).parent, run_dir.parent) if nested else (Path(recorded), run_dir)
    if not Path(path).is_relative_to(old_base):
        return path
    moved = new_base / Path(path).relative_to(old_base)
    return str(moved) if moved.exists() else path


def check_step(step: int) -> int:
    """`step` as a non-negative int; ValueError otherwise."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def atomic_write_parquet(table: pa.Table, dest: Path, *, durable: bool = True) -> None:
    """Write `table` to `dest` (zstd) atomically: `rlpipe.core.files.atomic_write`, whose
    `durable` this passes on."""
    atomic_write(dest, lambda tmp: pq.write_table(table, tmp, compression="zstd"), durable=durable)


def run_folder_bytes(run_dir: str | os.PathLike) -> dict[str, int]:
    """Bytes on disk under a run folder (a pipeline's phases included): `tables` (every tables/
    folder), `checkpoints` (every checkpoints/ folder), `other` (MLflow artifacts kept in the
    folder, reports, run.json, ...) and `total`."""
    sizes = {"tables": 0, "checkpoints": 0, "other": 0}
    root = Path(run_dir)
    for folder, _, files in os.walk(root):
        parts = Path(folder).relative_to(root).parts
        kind = "tables" if "tables" in parts else "checkpoints" if "checkpoints" in parts else "other"
        for name in files:
            try:
                sizes[kind] += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed while walking (a compaction or retention pass)
    return {**sizes, "total": sum(sizes.values())}


def human_bytes(count: int) -> str:
    """`count` bytes as B, KiB, MiB, GiB or TiB with three significant figures."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)} B"
    return f"{size:.3g} {unit}" if size < 1000 else f"{size:.0f} {unit}"
