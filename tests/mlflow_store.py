"""An MLflow SQLite store with its tables made, for tests that give each CLI run a store of its own.

MLflow makes a fresh store's tables by running its migrations (alembic loads some 70 scripts):
about 1 CPU-s in every process that opens a new store. A test that only needs a store of its own
gets a copy of one made once per test process. The path from a new store to a made one stays
tested where it matters: tests/unit/test_tracking.py starts four runs together on a fresh store,
and every in-process flow test opens a new one.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def _template() -> Path:
    from rlpipe.storage.tracking import tracking_client

    folder = Path(tempfile.mkdtemp(prefix="rlpipe-mlflow-template-"))
    tracking_client(f"sqlite:///{folder / 'mlflow.db'}")  # both stores' tables, migrated
    return folder / "mlflow.db"


def made_store(database: Path) -> str:
    """The tracking URI of `database`, a copy of a made store unless the file exists already."""
    if not database.exists():
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), database)
    return f"sqlite:///{database}"
