"""Run SQL over runs' tables, and the canned queries of dashboards/*.sql.

    run_sql(["runs/a", "runs/b"], "select run_id, count(*) from rollouts group by 1")  # pa.Table
    run_canned(["runs/a"], "reward_by_step")                                          # pa.Table
    canned_queries()  # name -> CannedQuery(name, description, path)

In a query each table name (rollouts, scores, ...) is the union over the given runs, with a
`run_id` column. Canned queries are plain files: `dashboards/<name>.sql`, whose first comment line
describes it and whose header comment documents its (stable) output columns. They are read as
files; no dashboards Python module is imported beyond the package itself.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
from rlpipe.storage.catalog import RunDirs, connect


@dataclass(frozen=True)
class CannedQuery:
    name: str
    description: str  # the first comment line
    path: Path

    def sql(self) -> str:
        return self.path.read_text()


def dashboards_dir() -> Path:
    """The folder of the installed `rlpipe.dashboards` package, where the *.sql files live (by
    its installed name: a bare `dashboards` resolved only from the checkout's root folder)."""
    return Path(str(importlib.resources.files("rlpipe.dashboards")))


def canned_queries(folder: Path | None = None) -> dict[str, CannedQuery]:
    """Every `<folder>/*.sql` (default: dashboards/) by name, sorted."""
    folder = dashboards_dir() if folder is None else folder
    queries = {}
    for path in sorted(folder.glob("*.sql")):
        queries[path.stem] = CannedQuery(path.stem, _first_comment(path), path)
    return queries


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.strip().startswith("--"):
            return line.strip().removeprefix("--").strip()
    return ""


def canned_sql(name: str) -> str:
    """The SQL text of canned query `name`; ValueError naming the known ones otherwise."""
    queries = canned_queries()
    if name not in queries:
        raise ValueError(f"unknown query {name!r}; known queries: {', '.join(queries)}")
    return queries[name].sql()


def run_sql(run_dirs: RunDirs, sql: str, con: duckdb.DuckDBPyConnection | None = None) -> pa.Table:
    """The result of `sql` over the runs' tables (duckdb.Error on a bad query)."""
    con = connect(run_dirs, con)
    result = con.sql(sql)
    if result is None:  # a statement without a result set
        return pa.table({})
    return result.to_arrow_table()


def run_canned(run_dirs: RunDirs, name: str) -> pa.Table:
    """The result of canned query `name` over the runs' tables."""
    return run_sql(run_dirs, canned_sql(name))
