"""Where a run's tables live on disk, and the one atomic-write primitive.

    <run_dir>/tables/<table>/step=<k>/part-0.parquet   one file per (table, step) partition
    <run_dir>/tables/<table>/_schema.parquet           zero rows: the table's current schema
    <run_dir>/catalog.duckdb                           DuckDB views over the above

A partition is a single file replaced with `os.replace` (atomic on POSIX), so a reader — or a
writer killed with SIGKILL — only ever sees the old file or the new one. Temporary files are named
`.<name>.<pid>.<hex>.tmp`: hidden, and not ending in `.parquet`, so no reader glob matches them.
The zero-row `_schema.parquet` keeps catalog views valid before any data exists (DuckDB refuses a
glob that matches no file) and gives every view the newest column set.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rlpipe.storage.schemas import schema_for

PART_NAME = "part-0.parquet"
SCHEMA_NAME = "_schema.parquet"
CATALOG_NAME = "catalog.duckdb"
_TMP_RE = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$")


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


def check_step(step: int) -> int:
    """`step` as a non-negative int; ValueError otherwise."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def atomic_write_parquet(table: pa.Table, dest: Path, *, durable: bool = True) -> None:
    """Write `table` to `dest` (zstd) through a hidden temporary file renamed over `dest`.

    durable: fsync the file before the rename, so a power cut cannot leave a renamed but
    empty file (a SIGKILL cannot either way), and its folder after it, so the rename itself
    survives a power cut (`fsync_written` covers the folders above, when they are new). Not durable: after a power cut the newest rename
    may be lost, leaving the previous file — still whole; `fsync_written` later makes it durable.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        if durable:
            fsync_path(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(dest.parent)


def fsync_written(files: list[Path], root: Path) -> None:
    """Make earlier writes durable: fsync each file, then each folder from the file's up to
    `root` (inclusive), each once, so renames and newly made folders survive a power cut.
    A file renamed away since (a later write replaced it) is skipped: its folder still is synced."""
    folders: dict[Path, None] = {}
    root = Path(root)
    for file in files:
        try:
            fsync_path(file)
        except FileNotFoundError:
            pass
        folder = file.parent
        while True:
            folders.setdefault(folder, None)
            if folder == root or folder == folder.parent or root not in folder.parents:
                break
            folder = folder.parent
    for folder in folders:
        fsync_path(folder)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a rename is durable only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_leftovers(folder: Path) -> list[Path]:
    """Delete temporary files in `folder` left by writers that died.

    A temporary file is removed only when the process named in it is gone, so a writer busy
    in another process or thread keeps its file. Writers call this on the folder they write to,
    so a resumed write of a (table, step) cleans what the killed one left there.
    """
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.glob(".*.tmp"):
        match = _TMP_RE.match(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
