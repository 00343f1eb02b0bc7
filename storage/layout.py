"""Where a run's tables live on disk, and how a partition is written atomically.

    <run_dir>/tables/<table>/step=<k>/part-0.parquet   one file per (table, step) partition
    <run_dir>/tables/<table>/steps=<a>-<b>/merged-<n>.parquet   closed steps a..b compacted (storage/compaction.py)
    <run_dir>/tables/<table>/_snapshot.json            the files that make up the table now (storage/snapshots.py)
    <run_dir>/tables/<table>/_schema.parquet           zero rows: the table's current schema
    <run_dir>/catalog.duckdb                           DuckDB views over the tables' snapshots

A mixture of environments (`[[task.envs]]`) partitions its `rollouts` by environment inside the
step: `tables/rollouts/step=<k>/env=<name>/part-0.parquet`, one file per environment of the step
(`partition_file(..., env=name)`); the table folder then holds the `_by_env` mark, set when the
run starts. Step first, env second: the step stays the one unit that stages write and replace,
that resume, replay, rescore, fates and lineage read, and that a run closes; the env folders
split a step's file by the `env` column the rows already carry (views read files, not folder
names, so every query is unchanged). `step_files` lists a step's files on disk either way (readers ask the snapshot:
storage/writer.py `step_files`); rows of
several files read back in their write order (`ENV_PARTITIONED` names the ordering columns).

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


ENV_PARTITIONED: dict[str, tuple[str, ...]] = {"rollouts": ("attempt", "sample_id")}
"""Tables a mixture partitions by environment, and the columns that put a step's rows back in
their write order (a round's rows, in sampling order, after the earlier rounds')."""
BY_ENV_MARK = "_by_env"


def partition_file(run_dir: str | os.PathLike, table: str, step: int, env: str | None = None) -> Path:
    """Path of the single Parquet file of one (table, step) partition, or of one environment's
    part of it (`env`, an env-partitioned table of a mixture run)."""
    folder = table_dir(run_dir, table) / f"step={check_step(step)}"
    return folder / PART_NAME if env is None else folder / f"env={check_env_name(env)}" / PART_NAME


def check_env_name(env: str) -> str:
    """`env` if it can name an `env=` folder; ValueError otherwise."""
    if not isinstance(env, str) or not env or env in (".", "..") or any(c in env for c in "/\=") \
            or any(ord(c) < 32 for c in env):
        raise ValueError(f"environment name {env!r} cannot name a partition folder")
    return env


def env_partitioned(run_dir: str | os.PathLike, table: str) -> bool:
    """Whether `table` of this run is partitioned by environment (its `_by_env` mark)."""
    return table in ENV_PARTITIONED and (table_dir(run_dir, table) / BY_ENV_MARK).is_file()


def mark_env_partitioned(run_dir: str | os.PathLike) -> None:
    """Partition this run's `ENV_PARTITIONED` tables by environment from their next write on
    (a mixture run, before its first step)."""
    for table in ENV_PARTITIONED:
        mark = table_dir(run_dir, table) / BY_ENV_MARK
        if not mark.is_file():
            mark.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(mark, lambda tmp: Path(tmp).write_bytes(b""))


def step_files(run_dir: str | os.PathLike, table: str, step: int) -> list[Path]:
    """The files of one (table, step) partition: its one file, else its environments' parts."""
    flat = partition_file(run_dir, table, step)
    if flat.is_file():
        return [flat]
    return sorted(path for path in flat.parent.glob(f"env=*/{PART_NAME}") if path.is_file())


def schema_file(run_dir: str | os.PathLike, table: str) -> Path:
    return table_dir(run_dir, table) / SCHEMA_NAME


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


def mlflow_run_ids(run_dir: str | os.PathLike) -> list[str]:
    """The MLflow run ids a run folder's run.json files name (a pipeline's and its phases')."""
    root, found = Path(run_dir), []
    for path in (root / "run.json", *sorted(root.glob("*/run.json"))):
        try:
            run_id = json.loads(path.read_text()).get("mlflow_run_id")
        except (OSError, ValueError):
            continue
        if run_id:
            found.append(run_id)
    return found


def size_lines(run_dir: str | os.PathLike, artifact_root: str | None) -> list[str]:
    """The run summary's size lines: the run folder by kind, then what its MLflow runs keep under
    `artifact_root` (a file URI; None: a store that decides for itself, not counted), telling hard
    links to the checkpoints' files (no space of their own) from bytes of their own."""
    from rlpipe.storage.model_artifacts import artifact_bytes, local_artifact_path

    size = run_folder_bytes(run_dir)
    lines = [f"  run folder {human_bytes(size['total'])}: tables {human_bytes(size['tables'])}, checkpoints "
             f"{human_bytes(size['checkpoints'])}, other {human_bytes(size['other'])}"]
    run_ids = mlflow_run_ids(run_dir)
    if not run_ids:
        return lines
    root = None if artifact_root is None else local_artifact_path(artifact_root)
    if root is None:
        return [*lines, "  MLflow artifacts: in the tracking server's store (not counted here)"]
    folders = [folder for run_id in run_ids for folder in root.glob(f"*/{run_id}")]
    stored = artifact_bytes(folders, Path(run_dir))
    return [*lines, f"  MLflow artifacts {human_bytes(stored['total'])} in {root}: {human_bytes(stored['linked'])} "
            f"hard links to checkpoint files (no space of their own), {human_bytes(stored['own'])} of their own; "
            f"written in all {human_bytes(size['total'] + stored['own'])}"]
