"""Compaction: closed step ranges merged into one file per range, read alike by every reader (views,
`read_table`, `is_complete`, polars), a step's fresh file winning over its compacted copy (a kill
between the merged file and the deletions, a step rewritten later), and kills during a pass."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from rlpipe.storage.background_writer import BackgroundWriter
from rlpipe.storage.catalog import connect, ensure_catalog, lazy_frame
from rlpipe.storage.compaction import compacted_files, fresh_files, stored_steps
from rlpipe.storage.queries import run_canned
from rlpipe.storage.writer import (
    compact_run,
    is_complete,
    read_table,
    write_table,
)

from tests import warm_cli
from tests.synthetic_runs import synthetic_step

HOOKS = Path(__file__).resolve().parents[1] / "fault_hooks"
ROOT = Path(__file__).resolve().parents[2]
STEPS = 25
TABLES = ("rollouts", "scores", "groups")


def make_run(run_dir: Path, steps: int = STEPS) -> None:
    for step in range(1, steps + 1):
        for name, table in synthetic_step(step, run_id="r", n_groups=3, group_size=4, n_token_rows=2).items():
            if name in TABLES:
                write_table(run_dir, name, step, table, run_id="r", durable=False)
    ensure_catalog(run_dir)


def snapshot(run_dir: Path) -> dict:
    """What every reader sees: view rows and counts, canned queries, read_table, polars."""
    con = connect([run_dir])
    seen = {}
    for table in TABLES:
        seen[table] = sorted(map(str, con.sql(f"select * from {table}").fetchall()))
        seen[f"{table}/read_table"] = read_table(run_dir, table).num_rows
        seen[f"{table}/polars"] = lazy_frame([run_dir], table).collect().height
    seen["reward_by_step"] = run_canned([run_dir], "reward_by_step").to_pylist()
    seen["zero_variance_by_step"] = run_canned([run_dir], "zero_variance_by_step").to_pylist()
    seen["step 12"] = read_table(run_dir, "scores", 12).to_pylist()
    return seen


def test_closed_ranges_merge_and_every_reader_sees_the_same_rows(tmp_path):
    make_run(tmp_path)
    before = snapshot(tmp_path)
    merged = compact_run(tmp_path, closed=21, width=10)
    # steps 1-9 and 10-19 merged; 20-29 is still open (a resume may rewrite steps 22-25)
    assert merged == {table: 19 for table in TABLES}
    assert [p.parent.name for p in compacted_files(tmp_path, "scores")] == ["steps=0-9", "steps=10-19"]
    assert [s for s, _ in fresh_files(tmp_path, "scores")] == list(range(20, 26))
    assert stored_steps(tmp_path, "scores") == list(range(1, 26))
    assert is_complete(tmp_path, "scores", 12) and not is_complete(tmp_path, "scores", 0)
    assert snapshot(tmp_path) == before
    with pytest.raises(FileNotFoundError):
        read_table(tmp_path, "scores", 30)
    # the on-disk catalog reads them alike
    import duckdb

    con = duckdb.connect(str(tmp_path / "catalog.duckdb"), read_only=True)
    assert con.sql("select count(*), count(distinct step) from scores").fetchall() == [(len(before["scores"]), 25)]
    con.close()
    assert compact_run(tmp_path, closed=21, width=10) == {}  # nothing left to merge


def test_a_fresh_file_wins_over_its_compacted_copy_and_is_merged_next(tmp_path):
    make_run(tmp_path, steps=10)
    compact_run(tmp_path, closed=10, width=5)
    # a step rewritten after its range was merged (a resume rewriting `origins`, a completed row)
    rewritten = read_table(tmp_path, "scores", 3).to_pylist()[:1]
    write_table(tmp_path, "scores", 3, [{**rewritten[0], "reward": 42.0}], run_id="r")
    con = connect([tmp_path])
    assert con.sql("select count(*), max(reward) from scores where step = 3").fetchall() == [(1, 42.0)]
    assert read_table(tmp_path, "scores", 3).column("reward").to_pylist() == [42.0]
    assert read_table(tmp_path, "scores").filter(pa.compute.equal(pa.compute.field("step"), 3)).num_rows == 1
    assert lazy_frame([tmp_path], "scores").collect().filter(step=3).height == 1
    assert compact_run(tmp_path, closed=10, width=5) == {"scores": 1}
    assert connect([tmp_path]).sql("select count(*), max(reward) from scores where step = 3").fetchall() == [(1, 42.0)]
    assert 3 not in [step for step, _ in fresh_files(tmp_path, "scores")]
    # the merged-away file stays on disk for readers that resolved an older snapshot, then goes
    assert (tmp_path / "tables" / "scores" / "step=3" / "part-0.parquet").is_file()
    compact_run(tmp_path, closed=10, width=5, grace=0)
    assert not (tmp_path / "tables" / "scores" / "step=3").exists()
    assert connect([tmp_path]).sql("select count(*), max(reward) from scores where step = 3").fetchall() == [(1, 42.0)]


CHILD = """
import sys
from rlpipe.storage.writer import compact_run
compact_run(sys.argv[1], closed=21, width=10, grace=float(sys.argv[2]))
"""


@pytest.mark.parametrize("point", [
    "after:*/scores/steps=10-19/merged-*.parquet",  # merged file in place, the snapshot not yet naming it
    "after:*/scores/_snapshot.json",  # the first range's commit done, the second not begun
    "before:*/groups/steps=0-9/merged-*.parquet",   # rollouts and scores done, groups not begun
    "after:*/rollouts/steps=10-19/merged-*.parquet+sweep",  # a pass that deletes retired files, killed
])
def test_a_kill_during_a_pass_loses_nothing_and_doubles_nothing(tmp_path, point):
    point, sweep = point.removesuffix("+sweep"), point.endswith("+sweep")
    make_run(tmp_path)
    before = snapshot(tmp_path)
    if sweep:  # files retired by an earlier pass (steps 1-9) are due for deletion in the killed one
        compact_run(tmp_path, closed=9, width=10)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
           "RLPIPE_TEST_KILL": point}
    child = warm_cli.run([sys.executable, "-c", CHILD, str(tmp_path), "0" if sweep else "600"], env=env,
                           capture_output=True, timeout=120)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    assert snapshot(tmp_path) == before
    compact_run(tmp_path, closed=21, width=10)  # the next pass finishes
    assert snapshot(tmp_path) == before
    assert all(len(fresh_files(tmp_path, table)) == 6 for table in TABLES)
    compact_run(tmp_path, closed=21, width=10, grace=0)  # retired files (and a killed pass's) go
    assert snapshot(tmp_path) == before
    left = {p.relative_to(tmp_path / "tables").parts[:2] for p in (tmp_path / "tables").rglob("*.parquet")}
    assert all(part.startswith(("steps=", "step=2", "_schema")) for _, part in left), sorted(left)


WRITER = """
import sys
from tests.synthetic_runs import synthetic_step
from rlpipe.storage.writer import write_table
write_table(sys.argv[1], "scores", 13, synthetic_step(13, run_id="r", n_groups=1, group_size=4, n_token_rows=0)["scores"],
            run_id="r")
"""


def test_a_write_killed_between_its_file_and_its_snapshot_is_not_read_and_is_written_again(tmp_path):
    make_run(tmp_path, steps=12)
    before = snapshot(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RLPIPE_TEST_KILL": "after:*/scores/step=13/part-0.parquet"}
    child = warm_cli.run([sys.executable, "-c", WRITER, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    assert (tmp_path / "tables" / "scores" / "step=3" / "part-0.parquet").is_file()
    assert snapshot(tmp_path) == before and not is_complete(tmp_path, "scores", 13)  # a resume writes it again
    write_table(tmp_path, "scores", 13, synthetic_step(13, run_id="r", n_groups=1, group_size=4, n_token_rows=0)["scores"],
                run_id="r")
    assert stored_steps(tmp_path, "scores") == list(range(1, 14)) and read_table(tmp_path, "scores", 13).num_rows == 4


def test_the_background_writer_compacts_after_the_writes_queued_before(tmp_path):
    steps = {step: synthetic_step(step, run_id="r", n_groups=2, group_size=2, n_token_rows=0)["scores"]
             for step in range(1, 9)}
    with BackgroundWriter() as writer:
        for step, table in steps.items():
            writer.submit(tmp_path, "scores", step, table, run_id="r")
        writer.compact(tmp_path, 7, width=4)
        assert writer.has_pending(tmp_path, "scores", 2) or writer.compacted  # a read of step 2 waits for it
        writer.drain()
        assert writer.compacted == 7 and not writer.has_pending(tmp_path, "scores", 2)
    assert [p.parent.name for p in compacted_files(tmp_path, "scores")] == ["steps=0-3", "steps=4-7"]
    assert [s for s, _ in fresh_files(tmp_path, "scores")] == [8]
    assert read_table(tmp_path, "scores").num_rows == sum(t.num_rows for t in steps.values())


def test_a_mixtures_rollouts_split_by_environment_stay_fresh_while_its_other_tables_merge(tmp_path):
    """A step split into its environments' parts is not merged (its files could not all go at
    once, and fresh wins over the merged copy), yet every reader sees each row exactly once."""
    import pyarrow.compute as pc
    from rlpipe.storage.layout import mark_env_partitioned

    mark_env_partitioned(tmp_path)
    for step in range(1, 13):
        for name, table in synthetic_step(step, run_id="r", n_groups=3, group_size=4, n_token_rows=2).items():
            if name in TABLES:
                if name == "rollouts":  # the groups alternate between two environments
                    envs = pa.array(["add" if i // 4 % 2 else "count" for i in range(table.num_rows)])
                    table = table.set_column(table.schema.get_field_index("env"), "env", envs)
                write_table(tmp_path, name, step, table, run_id="r", durable=False)
    ensure_catalog(tmp_path)
    before = snapshot(tmp_path)
    merged = compact_run(tmp_path, closed=12, width=5)
    assert merged == {"scores": 9, "groups": 9}  # steps 1-4 and 5-9 of the one-file tables
    assert compacted_files(tmp_path, "rollouts") == []
    rollouts = [p.relative_to(tmp_path / "tables" / "rollouts").as_posix() for _, p in fresh_files(tmp_path, "rollouts")]
    assert len(rollouts) == 24 and all("/env=" in path for path in rollouts)
    assert snapshot(tmp_path) == before
    rows = read_table(tmp_path, "rollouts")
    assert rows.num_rows == 12 * 3 * 4 and set(rows.column("env").to_pylist()) == {"add", "count"}
    assert pc.all(pc.equal(read_table(tmp_path, "rollouts", 7).column("step"), 7)).as_py()


def test_a_run_written_before_snapshots_reads_as_it_is_and_becomes_one_at_its_next_write(tmp_path):
    """A table folder without `_snapshot.json` (today's layout before snapshots, or a torn one)
    is read from its files by the fresh-wins rule; its next write or pass commits a snapshot."""
    make_run(tmp_path)
    compact_run(tmp_path, closed=21, width=10)
    before = snapshot(tmp_path)
    for table in TABLES:  # as an earlier rlpipe left it: the snapshot files gone, the data files kept
        (tmp_path / "tables" / table / "_snapshot.json").unlink()
    (tmp_path / "tables" / "groups" / "step=3" / "part-0.parquet").unlink(missing_ok=True)  # merged away before
    assert snapshot(tmp_path) == before
    (tmp_path / "tables" / "scores" / "_snapshot.json").write_text('{"format": 1, "vers')  # torn by a power cut
    assert snapshot(tmp_path) == before
    write_table(tmp_path, "scores", 26, synthetic_step(26, run_id="r", n_groups=3, group_size=4, n_token_rows=2)["scores"],
                run_id="r")
    assert stored_steps(tmp_path, "scores") == list(range(1, 27))
    assert (tmp_path / "tables" / "scores" / "_snapshot.json").read_text().startswith('{"format":1')
