"""`rlpipe sql`: query one or several runs' tables with DuckDB.

    rlpipe sql runs/demo "select step, avg(reward) from scores group by 1 order by 1"
    rlpipe sql runs/a runs/b --query reward_by_step --format csv
    rlpipe sql runs/a --query samples_by_step --format parquet --out samples.parquet
    rlpipe sql runs "select run, step, avg(reward) from scores group by all"   # every run under runs/
    rlpipe sql runs/demo/rl --as-of-step 40 --query reward_by_step      # the tables as after step 40
    rlpipe sql --list

Each table name is the union over the given runs, with a `run_id` column. A folder that is not a
run itself is a runs root: every run folder below it (one with tables/) joins the union, and the
views get a `run` column after run_id, the run's path relative to the root (e.g. `demo/rl`). Output is a table on
the terminal, or csv / json (an array of objects) / parquet on stdout or in --out. Nested values
(token lists, reward components) become JSON text in csv. Exit status 2, with a one-line message
on stderr, for a bad run folder, an unknown query name, and any SQL error (DuckDB's message).

Every table is read as of one snapshot, resolved when the command starts (storage/snapshots.py):
a run writing and compacting meanwhile changes nothing it reads. `--as-of-step N` reads each
table's rows of steps <= N only: the run as it stood after step N (a step rewritten later, by a
resume, reads as rewritten).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from rlpipe.storage.catalog import connect, discover_runs, has_data, run_dirs_list
from rlpipe.storage.cliargs import fail, parse_args
from rlpipe.storage.queries import canned_queries, canned_sql
from rlpipe.storage.schemas import TABLES

PROG = "rlpipe sql"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Query runs' tables (" + ", ".join(TABLES) + ") with DuckDB SQL.",
        epilog='example: rlpipe sql runs/demo "select step, avg(reward) from scores group by 1"',
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="RUN_DIR... [SQL]",
        help="run folders or runs roots, then the SQL (unless --query or --list)",
    )
    parser.add_argument(
        "--query", "-q", metavar="NAME", help="run the canned query NAME (see --list)"
    )
    parser.add_argument("--list", action="store_true", help="list the canned queries and exit")
    parser.add_argument(
        "--format", "-f", choices=("table", "csv", "json", "parquet"), default="table"
    )
    parser.add_argument(
        "--out", "-o", metavar="FILE", help="write the result here instead of stdout"
    )
    parser.add_argument(
        "--max-rows", type=int, default=100, help="rows shown by --format table (default 100)"
    )
    parser.add_argument(
        "--as-of-step", type=int, metavar="N",
        help="the tables as the run had them after step N: every table's rows of steps <= N",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv, intermixed=True)
    if isinstance(args, int):  # --help or a usage error
        return args
    if args.list:
        for name, query in canned_queries().items():
            print(f"{name:<24} {query.description}")
        return 0
    try:
        run_dirs, sql = _split_args(args)
        runs, labels = expand_runs(run_dirs)
        if args.format == "parquet" and not args.out:
            raise ValueError("--format parquet needs --out FILE")
        if args.as_of_step is not None and args.as_of_step < 0:
            raise ValueError(f"--as-of-step must be >= 0, got {args.as_of_step}")
    except ValueError as error:
        return fail(PROG, str(error))
    con = connect(runs, labels=labels, as_of_step=args.as_of_step)
    try:
        result = con.sql(sql)
        table = pa.table({}) if result is None else result.to_arrow_table()
    except duckdb.Error as error:
        return fail(PROG, _one_line(str(error)))
    _note_empty_tables(sql, runs)
    _emit(table, args)
    return 0


def _split_args(args: argparse.Namespace) -> tuple[list[str], str]:
    """(run folders, SQL text) from the positional arguments and --query."""
    positional = list(args.args)
    if args.query is not None:
        return positional, canned_sql(args.query)
    if len(positional) < 2:
        raise ValueError('give RUN_DIR... "SQL", or RUN_DIR... --query NAME (see --list)')
    return positional[:-1], positional[-1]


def expand_runs(paths: list[str]) -> tuple[list[Path], dict[Path, str] | None]:
    """Run folders of `paths` (a runs root stands for every run under it) and, when a root was
    given, each run's `run` label: its path relative to that root (a run given itself: as given)."""
    runs: dict[Path, str] = {}
    rooted = False
    for path in paths or [""]:
        folder = Path(path).resolve()
        if folder.is_dir() and not (folder / "tables").is_dir() and not (folder / "catalog.duckdb").is_file():
            rooted = True
            runs.update({run: label for run, label in discover_runs(folder).items() if run not in runs})
        else:
            runs.setdefault(run_dirs_list([path])[0], path)
    return list(runs), (runs if rooted else None)


def _one_line(message: str) -> str:
    """DuckDB's message without the echoed query and caret lines, on one line."""
    lines = []
    for line in message.splitlines():
        if line.startswith("LINE "):
            break
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines)
    if "Catalog Error" in text and "original_" in text:
        text += " (original_* tables exist in a rescore folder: rlpipe rescore RUN_DIR --reward ...)"
    elif "Catalog Error" in text and "Table" in text:
        text += f" (tables: {', '.join(TABLES)})"
    return text


def _note_empty_tables(sql: str, runs: list[Path]) -> None:
    try:
        # a bare connection: DuckDB 2.0 fails get_table_names on one whose views read Parquet
        referenced = duckdb.connect().get_table_names(sql)
    except duckdb.Error:
        return
    for table in TABLES:
        if table in referenced and not has_data(runs, table):
            where = ", ".join(str(run) for run in runs)
            print(f"{PROG}: note: table {table!r} has no data yet in {where}", file=sys.stderr)


def _emit(table: pa.Table, args: argparse.Namespace) -> None:
    if args.format == "parquet":
        pq.write_table(table, args.out, compression="zstd")
        return
    if args.format == "table":
        _render(table, args.max_rows, args.out)
    elif args.format == "csv":
        sink = pa.BufferOutputStream()
        pacsv.write_csv(_nested_as_json(table), sink)
        _write_text(sink.getvalue().to_pybytes().decode(), args.out)
    else:
        rows = [{key: _jsonable(value) for key, value in row.items()} for row in table.to_pylist()]
        _write_text(json.dumps(rows, default=str) + "\n", args.out)


def _write_text(text: str, out: str | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)


def _jsonable(value: Any) -> Any:
    """Python value of an Arrow cell, as JSON can hold it (NaN -> null, maps -> objects)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        if value and all(isinstance(item, tuple) and len(item) == 2 for item in value):
            return {str(key): _jsonable(item) for key, item in value}  # a map
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    return value


def _nested_as_json(table: pa.Table) -> pa.Table:
    """Nested columns (lists, maps, structs) as JSON text, which csv can hold."""
    columns = []
    for column in table.columns:
        if pa.types.is_nested(column.type):
            texts = [
                None if value is None else json.dumps(_jsonable(value), default=str)
                for value in column.to_pylist()
            ]
            column = pa.array(texts, type=pa.string())
        columns.append(column)
    return pa.Table.from_arrays(columns, names=table.column_names)


def _render(table: pa.Table, max_rows: int, out: str | None) -> None:
    from rich.console import Console  # rich only for this format
    from rich.measure import Measurement
    from rich.table import Table

    view = Table(show_header=True, header_style="bold")
    for name in table.column_names:  # a cell too wide for the screen wraps, never ends in '…'
        view.add_column(name, overflow="fold", min_width=min(len(name), 24))
    for row in table.slice(0, max_rows).to_pylist():
        view.add_row(*(_cell(value) for value in row.values()))
    console = Console(file=io.StringIO()) if out else Console()
    if out or not console.is_terminal:  # a file or a pipe: every table at its full width
        console.width = max(console.width, Measurement.get(console, console.options.update_width(10**5), view).maximum)
    console.print(view)
    shown = min(max_rows, table.num_rows)
    console.print(
        f"{table.num_rows} row(s)" + (f", first {shown} shown" if shown < table.num_rows else "")
    )
    if out:
        Path(out).write_text(console.file.getvalue())


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, dict)):
        text = json.dumps(_jsonable(value), default=str)
        return text if len(text) <= 80 else text[:77] + "..."
    return str(value)
