"""Read a run's tables — one run or several — as DuckDB relations or polars LazyFrames.

    con = connect(["runs/a", "runs/b"])      # in-memory DuckDB, one view per table (with run_id)
                                             # and the derived views of storage/views.py (fates)
    con.sql("select run_id, step, avg(reward) from scores group by all")
    relation(["runs/a"], "groups")           # DuckDBPyRelation
    lazy_frame(["runs/a", "runs/b"], "scores")  # polars LazyFrame

`<run_dir>/catalog.duckdb` holds the same views for a single run, so
`duckdb runs/x/catalog.duckdb "select ..."` works without Python. Every view reads the files of its
table's snapshot, spelled out (storage/snapshots.py; storage/compaction.py `snapshot_sql`):
`read_parquet([<abs>/tables/<t>/_schema.parquet, <fresh files>], union_by_name=false,
hive_partitioning=false)` and, by name, the merged files less the steps a fresh file holds. The
zero-row schema file comes first in each scan: it gives the current columns and keeps a scan of
no data file valid. `connect` resolves the snapshots when it is called; the on-disk catalog is
rebuilt under a temporary name and renamed into place (`ensure_catalog`) by the run's background
writer while it writes (storage/background_writer.py), so a reader holding the old file keeps
reading its snapshot and a writer never waits for a reader's lock. Nothing globs the data files.

union_by_name is off by default: it makes DuckDB read every file's footer when binding a view,
~0.2 s per 500 partitions and per table, and the writer gives all files of a table one schema.
The schema file sorts first in the glob, so views take the current columns; a partition written
under an older schema with fewer columns then fails loudly ("schema mismatch ... try
union_by_name=True") — pass union_by_name=True to read such runs. Paths are absolute: DuckDB resolves relative paths
against the reader's working directory, not the database file (checked on DuckDB 2.0), so a
relative view would read nothing, or another folder's files, from anywhere but the run folder.
A moved or copied run folder's catalog therefore still names the old folder until it is rebuilt:
`connect` (every `rlpipe` command that reads tables: sql, report, rescore, replay's readers) and
every resume rebuild it from the folder actually opened (`refresh_if_moved`). A rescore folder
inside its run names the run relatively (`rescore.json`), so it moves with it.

Readers here use in-memory connections, and the catalog is replaced, never opened for writing
in place, so a run that is writing never conflicts with a reader.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write
from rlpipe.storage.compaction import (
    compacted_files,
    fresh_files,
    snapshot_sql,
    stored_steps,
    table_snapshot,
)
from rlpipe.storage.layout import (
    CATALOG_NAME,
    atomic_write_parquet,
    schema_file,
    tables_root,
)
from rlpipe.storage.schemas import META_VERSION, SCHEMA_VERSION, TABLES, schema_for
from rlpipe.storage.views import VIEWS

if TYPE_CHECKING:
    import polars as pl

RESCORE_MARKER = "rescore.json"
_NOT_RUNS = frozenset({"tables", "checkpoints", "mlartifacts"})
RunDirs = str | os.PathLike | Iterable[str | os.PathLike]
# Serialises catalog refreshes of this process: concurrent CREATE VIEWs on one DuckDB file from
# threads fail with a write-write conflict. (Across processes DuckDB's file lock decides.)
_CATALOG_LOCK = threading.Lock()


def run_dirs_list(run_dirs: RunDirs) -> list[Path]:
    """Absolute run folders; ValueError naming the first one that is not a run folder."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    paths = [Path(run_dir).resolve() for run_dir in run_dirs]
    if not paths:
        raise ValueError("no run directory given")
    for path in paths:
        if not path.is_dir():
            raise ValueError(f"not a run directory: {path} does not exist")
        if not (tables_root(path).is_dir() or (path / CATALOG_NAME).is_file()):
            raise ValueError(f"not a run directory: {path} has no tables/ folder")
    return paths


def rescore_source(run_dir: Path) -> tuple[Path, tuple[str, ...]] | None:
    """(the run it re-scores, the tables it holds) of a rescore folder (`rescore.json`,
    tasks/rescoring.py), or None for a run folder. Its other tables are the source run's."""
    marker = Path(run_dir) / RESCORE_MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    source = Path(info["source_run_dir"])  # relative to the rescore folder when inside its run
    return (source if source.is_absolute() else (Path(run_dir) / source)).resolve(), tuple(info["tables"])


def _table_home(run_dir: Path, table: str) -> Path:
    """The folder whose tables/<table> a run's view reads: its own, or a rescore's source run's."""
    source = rescore_source(run_dir)
    return run_dir if source is None or table in source[1] else source[0]


def discover_runs(root: str | os.PathLike) -> dict[Path, str]:
    """Every run folder (one with tables/) at or under `root` → its path relative to root
    ("." for root itself), sorted. Rescore folders are left out: their rows re-state a run's.
    Does not look inside tables/, checkpoints/ or hidden folders."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise ValueError(f"not a runs root: {root} does not exist")
    found: dict[Path, str] = {}
    for folder, subfolders, _ in os.walk(root):
        path = Path(folder)
        if (path / RESCORE_MARKER).is_file():
            subfolders.clear()
            continue
        if tables_root(path).is_dir():
            found[path] = path.relative_to(root).as_posix()
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in _NOT_RUNS)
    if not found:
        raise ValueError(f"no run folders (folders with tables/) under {root}")
    return found


def ensure_schema_file(run_dir: str | os.PathLike, table: str) -> Path:
    """Write `tables/<table>/_schema.parquet` (zero rows) unless it has the current schema version."""
    path = schema_file(run_dir, table)
    if path.is_file():
        metadata = pq.read_schema(path).metadata or {}
        if metadata.get(META_VERSION) == str(SCHEMA_VERSION).encode():
            return path
    atomic_write_parquet(schema_for(table).empty_table(), path, durable=False)
    return path


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _source(run_dir: Path, table: str, union_by_name: bool, as_of_step: int | None = None) -> str | None:
    """A SELECT over exactly the files of one run's `table` snapshot, resolved now
    (storage/snapshots.py; storage/compaction.py `snapshot_sql`), through `as_of_step` when
    given; None when the table has neither a schema file nor data."""
    home = _table_home(run_dir, table)
    snapshot = table_snapshot(home, table)
    schema = schema_file(home, table)
    last = float("inf") if as_of_step is None else as_of_step
    fresh = [file for step, file in fresh_files(home, table, snapshot) if step <= last]
    merged = [file for file in compacted_files(home, table, snapshot)
              if min(snapshot.merged[file.relative_to(schema.parent).as_posix()], default=0) <= last]
    options = f"union_by_name={str(union_by_name).lower()}, hive_partitioning=false"
    sql = snapshot_sql(schema if schema.is_file() else None, fresh, merged, snapshot.shadowed(), options, _quote)
    return sql if sql is None or as_of_step is None else f"SELECT * FROM ({sql}) WHERE step <= {int(as_of_step)}"


def ensure_catalog(
    run_dir: str | os.PathLike, *, quiet_if_busy: bool = False, union_by_name: bool = False
) -> Path:
    """Create or refresh `<run_dir>/catalog.duckdb`: schema files and one view per table.

    quiet_if_busy: when another process holds the database (e.g. an open `duckdb` shell),
    warn and return instead of raising — a run must not fail over its catalog.
    """
    run_dir = Path(run_dir).resolve()
    for _, home, table in _views(run_dir):  # a rescore folder's views also read its source run
        ensure_schema_file(home, table)
    path = run_dir / CATALOG_NAME
    try:
        with _CATALOG_LOCK:
            _create_views(path, run_dir, union_by_name)
    except duckdb.Error as error:  # held by another process
        if not quiet_if_busy:
            raise
        warnings.warn(f"catalog {path} not refreshed: {error}", stacklevel=2)
    return path


def catalog_is_current(run_dir: str | os.PathLike) -> bool:
    """Whether `<run_dir>/catalog.duckdb` reads this folder's tables (not those of the folder it
    was built at before a move or copy). True when it cannot be opened now (a writer holds it for
    the milliseconds of a refresh: that writer builds it here)."""
    run_dir = Path(run_dir).resolve()
    expected = str(tables_root(_table_home(run_dir, "rollouts")) / "rollouts")
    try:
        con = duckdb.connect(str(run_dir / CATALOG_NAME), read_only=True)
    except duckdb.Error:
        return True
    try:
        rows = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'rollouts' AND NOT internal").fetchall()
    except duckdb.Error:
        return False
    finally:
        con.close()
    return bool(rows) and _quote(f"{expected}/")[:-1] in rows[0][0]


def refresh_if_moved(run_dir: str | os.PathLike) -> None:
    """Rebuild `<run_dir>/catalog.duckdb` when it names another folder (the run was moved or
    copied); a catalog that cannot be rewritten (read-only folder, held open) is warned about."""
    run_dir = Path(run_dir)
    if not (run_dir / CATALOG_NAME).is_file() or catalog_is_current(run_dir):
        return
    try:
        ensure_catalog(run_dir, quiet_if_busy=True)
    except OSError as error:
        warnings.warn(f"catalog {run_dir / CATALOG_NAME} names another folder and could not be rebuilt: "
                      f"{error}", stacklevel=2)


def _create_views(path: Path, run_dir: Path, union_by_name: bool) -> None:
    """Build the catalog under a temporary name and rename it over `path`: a reader that has the
    old file open keeps reading its snapshot, and a writer never waits for a reader's lock."""
    def build(tmp: Path) -> None:
        con = duckdb.connect(str(tmp))
        try:
            for name, home, table in _views(run_dir):
                source = _source(home, table, union_by_name)  # ensure_catalog wrote every schema file
                con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {source}')
            for name, select in VIEWS.items():
                con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {select}')
        finally:
            con.close()

    atomic_write(path, build, durable=False)


def _views(run_dir: Path) -> list[tuple[str, Path, str]]:
    """(view name, folder, table) of a run's catalog; a rescore folder adds `original_<table>`
    over its source run for each table it re-states."""
    views = [(table, _table_home(run_dir, table), table) for table in TABLES]
    source = rescore_source(run_dir)
    if source is not None:
        views += [(f"original_{table}", source[0], table) for table in source[1]]
    return views


def has_data(run_dirs: RunDirs, table: str) -> bool:
    """Whether any of the runs has at least one partition of `table`."""
    return any(stored_steps(run_dir, table) for run_dir in run_dirs_list(run_dirs))


def connect(
    run_dirs: RunDirs, con: duckdb.DuckDBPyConnection | None = None, *, union_by_name: bool = False,
    labels: Mapping[Path, str] | None = None, as_of_step: int | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (new, in-memory, unless given) with one view per table over all runs.

    Each view is the union by column name of the runs' partitions; `run_id` tells rows apart.
    Each run's tables are resolved once, here, to the files of their snapshots
    (storage/snapshots.py): the views read the tables as of this call, however long they are used.
    as_of_step: only rows of steps <= it (the tables as the run had them after that step).
    A table with no data in any run is an empty view with the table's columns.
    labels: a name per run folder (`discover_runs`): every view then has a `run` column after
    `run_id`. Rescore folders among the runs also get `original_<table>` views (their source's).
    """
    runs = run_dirs_list(run_dirs)
    for run in runs:  # the on-disk catalog of a moved or copied run, re-pointed here
        refresh_if_moved(run)
    con = duckdb.connect() if con is None else con
    sources = {run: source for run in runs if (source := rescore_source(run)) is not None}
    views = [(table, table, {run: run for run in runs}) for table in TABLES]
    for table in sorted({t for _, tables in sources.values() for t in tables}):
        homes = {run: src for run, (src, tables) in sources.items() if table in tables}
        views.append((f"original_{table}", table, homes))
    for name, table, homes in views:
        parts = [(run, sql) for run, home in homes.items() if (sql := _source(home, table, union_by_name, as_of_step))]
        if parts:
            select = _select(parts, labels)
        else:
            con.register(f"_empty_{table}", schema_for(table).empty_table())
            select = f'SELECT {_columns(None, labels)} FROM "_empty_{table}"'
        con.execute(f'CREATE OR REPLACE TEMP VIEW "{name}" AS {select}')
    for name, select in VIEWS.items():
        if labels is not None:  # the derived views name their columns: add `run` from the runs' rollouts
            select = (f"SELECT v.run_id, n.run, v.* EXCLUDE (run_id) FROM ({select}) v LEFT JOIN "
                      "(SELECT DISTINCT run_id, run FROM rollouts) n ON n.run_id = v.run_id")
        con.execute(f'CREATE OR REPLACE TEMP VIEW "{name}" AS {select}')
    return con


def _columns(label: str | None, labels: Mapping[Path, str] | None) -> str:
    """`*`, or with labels the run's name as a `run` column right after run_id."""
    if labels is None:
        return "*"
    value = "NULL::VARCHAR" if label is None else _quote(label)
    return f"run_id, {value} AS run, * EXCLUDE (run_id)"


def _select(parts: list[tuple[Path, str]], labels: Mapping[Path, str] | None) -> str:
    """One SELECT over the runs' snapshots; with labels, each tagged with its run's `run` name."""
    return " UNION ALL BY NAME ".join(
        f"SELECT {_columns(None if labels is None else labels[run], labels)} FROM ({sql})" for run, sql in parts)


def relation(
    run_dirs: RunDirs, table: str, con: duckdb.DuckDBPyConnection | None = None
) -> duckdb.DuckDBPyRelation:
    """`table` over all runs as a DuckDB relation (on `con`, or a new in-memory connection)."""
    schema_for(table)
    return connect(run_dirs, con).table(table)


def lazy_frame(run_dirs: RunDirs, table: str) -> pl.LazyFrame:
    """`table` over all runs as a polars LazyFrame with the table's columns (run_id included)."""
    import polars as pl  # only here: the rest of storage needs no polars

    schema = pl.from_arrow(schema_for(table).empty_table()).schema

    def scan(files: list[Path]) -> pl.LazyFrame:
        return pl.scan_parquet([str(f) for f in files], schema=schema, hive_partitioning=False,
                               missing_columns="insert", extra_columns="ignore")

    frames = []
    for run in run_dirs_list(run_dirs):  # each step from its fresh file where one exists (compaction.py)
        snapshot = table_snapshot(run, table)  # resolved once: the frame reads these files
        fresh = fresh_files(run, table, snapshot)
        if fresh:
            frames.append(scan([path for _, path in fresh]))
        if compacted := compacted_files(run, table, snapshot):
            frames.append(scan(compacted).filter(~pl.col("step").is_in(sorted(snapshot.shadowed()))))
    return pl.concat(frames) if frames else pl.LazyFrame(schema=schema)
