"""A writer killed with SIGKILL mid-write leaves every partition whole: old or new, never partial.

A child process rewrites partitions of large rollouts in a loop (each partition's `attempt`
column holds the child's version number) while this process reads them with DuckDB; the child
is killed at a random moment. Readers must only ever see whole partitions of one version.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rlpipe.storage.compaction import fresh_files
from rlpipe.storage.writer import write_table

from tests import warm_cli
from tests.synthetic_runs import synthetic_step

ROOT = Path(__file__).resolve().parents[2]  # the child imports tests.synthetic_runs from here
ROWS = 2400
STEPS = 6
CHILD = f"""
import sys
import pyarrow as pa
from tests.synthetic_runs import synthetic_step
from rlpipe.storage.writer import write_table
run, version = sys.argv[1], int(sys.argv[2])
table = synthetic_step(1, run_id="r", n_groups=300, group_size=8, n_token_rows=2400)["rollouts"].drop_columns(["step"])
table = table.set_column(table.schema.get_field_index("attempt"), "attempt", pa.array([version] * table.num_rows, pa.int32()))
print("ready", flush=True)
while True:
    for step in range({STEPS}):
        write_table(run, "rollouts", step, table, run_id="r")
"""


def _versions_seen(run: Path) -> dict[int, tuple[int, int, int]]:
    """step -> (rows, min attempt, max attempt) as DuckDB sees the partitions now."""
    glob = str(
        run / "tables" / "rollouts" / "*" / "*.parquet"
    )  # the loosest glob a user might write
    rows = duckdb.sql(
        f"select step, count(*), min(attempt), max(attempt) from read_parquet('{glob}', hive_partitioning=false) group by step"
    ).fetchall()
    return {step: (n, low, high) for step, n, low, high in rows}


def _check_whole(seen: dict[int, tuple[int, int, int]], max_version: int) -> None:
    for step, (n, low, high) in seen.items():
        assert n == ROWS, f"step {step}: {n} rows, a partial partition"
        assert low == high <= max_version, f"step {step}: versions {low}..{high} mixed"


def test_sigkill_mid_write_leaves_whole_partitions(tmp_path):
    run = tmp_path / "run"
    base = synthetic_step(1, run_id="r", n_groups=300, group_size=8, n_token_rows=0)[
        "rollouts"
    ].drop_columns(["step"])
    index = base.schema.get_field_index("attempt")
    base = base.set_column(index, "attempt", pc.multiply(base["attempt"], 0))  # version 0
    for step in range(4):
        write_table(run, "rollouts", step, base, run_id="r")
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for version in range(1, 5):
        child = warm_cli.Popen(
            [sys.executable, "-c", CHILD, str(run), str(version)], stdout=subprocess.PIPE, env=env
        )
        assert child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + rng.uniform(0.2, 1.0)
        reads = 0
        while time.monotonic() < deadline:  # read while the child writes
            _check_whole(_versions_seen(run), version)
            reads += 1
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert reads > 0
        seen = _versions_seen(run)
        _check_whole(seen, version)
        assert set(range(4)) <= set(seen), "a partition written before the kill disappeared"
        for _, path in fresh_files(run, "rollouts"):
            assert pq.ParquetFile(path).metadata.num_rows == ROWS
    # leftovers of the killed writers are hidden, and a later write of the partition removes them
    for step in range(STEPS):
        write_table(run, "rollouts", step, base, run_id="r")
    assert not list((run / "tables").rglob("*.tmp"))
    assert {step: n for step, (n, _, _) in _versions_seen(run).items()} == {
        step: ROWS for step in range(STEPS)
    }
