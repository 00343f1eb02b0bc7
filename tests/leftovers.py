"""What a killed writer may leave in a tables folder, checked the way a reader meets it."""

from __future__ import annotations

from pathlib import Path

from rlpipe.core.files import clean_leftovers
from rlpipe.storage.layout import BY_ENV_MARK, PART_NAME, SCHEMA_NAME
from rlpipe.storage.snapshots import LOCK_NAME, SNAPSHOT_NAME


def strays(tables: Path) -> list[Path]:
    """Files under `tables` (a run's tables folder, or one table's) that are neither a partition
    (`step=N/part-0.parquet`, or a mixture's `step=N/env=NAME/part-0.parquet`), a table's
    `_schema.parquet`, `_by_env` mark, `_snapshot.json` or its writers' lock file, nor a temporary file of a dead writer: each folder is cleaned the
    way a resumed writer cleans it (`clean_leftovers`, which removes only temporary files named as
    `core/files.py` names them, of processes that are gone), then whatever is left besides
    partitions is returned. Call it once every writer of `tables` has exited."""
    for folder in {p.parent for p in tables.rglob("*") if p.is_file()}:
        clean_leftovers(folder)
    return sorted(p for p in tables.rglob("*") if p.is_file() and p.name not in (SCHEMA_NAME, BY_ENV_MARK, SNAPSHOT_NAME, LOCK_NAME)
                  and not (p.name == PART_NAME and p.parent.name.startswith("step="))
                  and not (p.name == PART_NAME and p.parent.name.startswith("env=")
                           and p.parent.parent.name.startswith("step=")))
