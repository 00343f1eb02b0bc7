"""Schemas, the atomic writer and the readers of storage/."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlpipe.storage import catalog
from rlpipe.storage.layout import partition_file, schema_file
from rlpipe.storage.schemas import (
    META_TABLE,
    META_VERSION,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLES,
    schema_for,
)
from rlpipe.storage.views import VIEWS
from rlpipe.storage.writer import conform, is_complete, read_table, write_table

# One full row per table (run_id and step left to the writer), values exact in float32.
EXAMPLE_ROWS: dict[str, dict] = {
    "rollouts": dict(
        policy_version=2,
        env="arithmetic",
        example_id="17",
        group_id="g1",
        sample_id="g1-0",
        attempt=1,
        prompt_tokens=[1, 2, 3],
        completion_tokens=[4, 5],
        completion_logprobs=[-0.5, -0.25],
        finish_reason="stop",
        prompt_text="1+2=",
        completion_text="3",
        n_prompt_tokens=3,
        n_completion_tokens=2,
        n_turns=1,
        turns=[{"turn": 0, "producer": "model", "start": 0, "length": 2, "reward": None}],
        messages='[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]',
        thinking_tokens=0,
        answer_tokens=2,
        answer_text="3",
        first_policy_version=2,
        last_policy_version=3,
        teacher_logprobs=[-0.5, -1.5, -0.25],
        teacher="teacher-v1",
        teacher_checkpoint="/models/teacher",
        teacher_url="http://127.0.0.1:8001",
    ),
    "scores": dict(
        sample_id="g1-0",
        group_id="g1",
        reward=1.0,
        components={"correct": 1.0, "format": 0.5},
        error=None,
    ),
    "groups": dict(
        group_id="g1",
        env="arithmetic",
        example_id="17",
        policy_version=2,
        n=8,
        reward_mean=0.5,
        reward_std=0.25,
        zero_variance=False,
        kept=True,
        attempts=2,
        status="trained",
    ),
    "advantages": dict(sample_id="g1-0", group_id="g1", advantage=-0.75),
    "batches": dict(
        batch_id=0,
        sample_ids=["g1-0", "g1-1"],
        n_sequences=2,
        n_tokens=10,
        n_pad=2,
        cu_seqlens=[0, 5, 10],
    ),
    "train_steps": dict(
        mode="rl",
        loss=0.125,
        grad_norm=1.5,
        lr=1e-4,
        tokens=1024,
        tokens_per_second=2000.0,
        seconds_generate=1.0,
        seconds_score=0.5,
        seconds_filter=None,
        seconds_pack=0.01,
        seconds_train=2.0,
        seconds_checkpoint=None,
        seconds_sync=None,
        seconds_eval=None,
        seconds_total=3.5,
        clip_fraction=0.0625,
        ratio_mean=1.0,
        logprob_gap=0.001,
        entropy=1.25,
        kl=0.002,
    ),
    "checkpoints": dict(
        policy_version=3,
        path="checkpoints/step_000003",
        sha256="ab" * 32,
        mlflow_model_name="demo",
        mlflow_model_version="2",
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    ),
    "syncs": dict(
        engine="torch",
        checkpoint_path="checkpoints/step_000003",
        policy_version=3,
        seconds=0.25,
        ok=True,
        error=None,
    ),
    "decisions": dict(sample_id="g1-0", group_id="g1", status="trained", reason="trained at step 1"),
    "curriculum": dict(attempt=1, env="arithmetic", example_id="0", status="skipped", state="solved", passed=8,
                       counted=8, reason="solved: 8 of its last 8 completions passed (reward >= 1); skipped"),
    "train_tokens": dict(
        batch_id=0,
        sample_ids=["", "g1-0"],
        tokens=[1, 2, 3, 4, 5],
        position_ids=[0, 1, 2, 3, 4],
        cu_seqlens=[0, 2, 5],
        labels=[2, -100, 4, 5, -100],
        token_weights=[0.0, 0.0, -0.75, -0.75, 0.0],
        log_probs=[0.0, 0.0, -0.5, -0.25, 0.0],
        rewards=[0.0, 1.0],
        prefix_index=[-1, 0],
        loss_mask=[False, False, True, True, False],
        trainer_logprobs=[0.0, 0.0, -0.5, -0.125, 0.0],
        token_sample=[-1, -1, 1, 1, -1],
        token_position=[-1, -1, 0, 1, -1],
    ),
    "evals": dict(
        env="arithmetic",
        example_id="5",
        reward=0.5,
        correct=True,
        prompt_text="2+2=",
        completion_text="4",
        sample=2,
        answer="4",
    ),
    "origins": dict(
        parent_checkpoint="/runs/demo/sft/checkpoints/step_000040",
        parent_run_dir="/runs/demo/sft",
        parent_run_id="demo/sft",
        parent_step=40,
        parent_model_name="demo-sft",
        parent_model_version="1",
    ),
}


def test_every_table_has_an_example_row_and_key_columns():
    assert set(EXAMPLE_ROWS) == set(TABLES)
    for table, schema in SCHEMAS.items():
        assert schema.names[:2] == ["run_id", "step"]
        assert schema.metadata[META_TABLE] == table.encode()
        assert set(EXAMPLE_ROWS[table]) == set(schema.names) - {"run_id", "step"}
    rollouts = schema_for("rollouts")
    assert rollouts.field("completion_tokens").type == pa.list_(pa.int32())
    assert rollouts.field("completion_logprobs").type == pa.list_(pa.float32())


@pytest.mark.parametrize("table", TABLES)
def test_round_trip(tmp_path, table):
    run = tmp_path / "run-a"
    path = write_table(run, table, 3, [EXAMPLE_ROWS[table]])
    assert path == run / "tables" / table / "step=3" / "part-0.parquet"
    back = read_table(run, table, 3)
    assert back.schema.equals(schema_for(table))
    row = back.to_pylist()[0]
    expected = {"run_id": "run-a", "step": 3, **EXAMPLE_ROWS[table]}
    if table == "scores":  # a map comes back as (key, value) pairs
        row["components"] = dict(row["components"])
    assert row == expected
    metadata = pq.read_schema(path).metadata
    assert metadata[META_VERSION] == str(SCHEMA_VERSION).encode()
    assert metadata[META_TABLE] == table.encode()
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    # DuckDB reads the same row through the run's views
    got = catalog.relation(run, table).fetchall()
    assert len(got) == 1 and got[0][:2] == ("run-a", 3)


def test_inputs_as_table_rows_or_columns_are_equal(tmp_path):
    rows = [dict(sample_id=f"s{i}", group_id="g", advantage=float(i)) for i in range(4)]
    columns = {
        "sample_id": [r["sample_id"] for r in rows],
        "group_id": ["g"] * 4,
        "advantage": [0.0, 1.0, 2.0, 3.0],
    }
    write_table(tmp_path, "advantages", 1, rows, run_id="r")
    write_table(tmp_path, "advantages", 2, columns, run_id="r")
    write_table(tmp_path, "advantages", 3, pa.table(columns), run_id="r")
    parts = [read_table(tmp_path, "advantages", step).drop_columns(["step"]) for step in (1, 2, 3)]
    assert parts[0].equals(parts[1]) and parts[1].equals(parts[2])


def test_rewrite_replaces_never_duplicates(tmp_path):
    rows = [dict(sample_id=f"s{i}", group_id="g", advantage=1.0) for i in range(5)]
    write_table(tmp_path, "advantages", 7, rows)
    write_table(tmp_path, "advantages", 8, rows[:2])
    write_table(tmp_path, "advantages", 7, rows[:3])
    assert read_table(tmp_path, "advantages", 7).num_rows == 3
    assert read_table(tmp_path, "advantages").num_rows == 5
    counts = (
        catalog.connect(tmp_path)
        .sql("select step, count(*) from advantages group by 1 order by 1")
        .fetchall()
    )
    assert counts == [(7, 3), (8, 2)]
    assert sorted(p.name for p in (tmp_path / "tables" / "advantages" / "step=7").iterdir()) == [
        "part-0.parquet"
    ]


@pytest.mark.parametrize(
    ("row", "column"),
    [
        (dict(sample_id="s", group_id="g", advantage="high"), "advantage"),
        (dict(sample_id="s", group_id="g"), "advantage"),
        (dict(sample_id="s", group_id="g", advantage=1.0, bogus=1), "bogus"),
        (dict(sample_id=None, group_id="g", advantage=1.0), "sample_id"),
        (dict(sample_id="s", group_id="g", advantage=1.0, step=4), "step"),
    ],
)
def test_bad_rows_are_rejected_before_writing(tmp_path, row, column):
    with pytest.raises(ValueError, match=f"'{column}'"):
        write_table(tmp_path, "advantages", 5, [row])
    assert not is_complete(tmp_path, "advantages", 5)
    assert not (tmp_path / "tables" / "advantages" / "step=5").exists()


def test_bad_types_name_the_column():
    with pytest.raises(ValueError, match="'completion_tokens'"):
        conform(
            "rollouts",
            [{**EXAMPLE_ROWS["rollouts"], "completion_tokens": [1, 2**40]}],
            run_id="r",
            step=1,
        )
    with pytest.raises(ValueError, match="'n'"):
        conform(
            "groups",
            {**{k: [v] for k, v in EXAMPLE_ROWS["groups"].items()}, "n": [1.5]},
            run_id="r",
            step=1,
        )
    with pytest.raises(ValueError, match="unknown table 'rollout'"):
        write_table("/nonexistent", "rollout", 1, [])
    with pytest.raises(ValueError, match="step"):
        write_table("/nonexistent", "scores", -1, [])


def test_is_complete_and_empty_partition(tmp_path):
    assert not is_complete(tmp_path, "evals", 0)
    write_table(tmp_path, "evals", 0, [])
    assert is_complete(tmp_path, "evals", 0)
    assert read_table(tmp_path, "evals", 0).num_rows == 0
    with pytest.raises(FileNotFoundError, match="step 9"):
        read_table(tmp_path, "evals", 9)
    assert read_table(tmp_path, "groups").num_rows == 0


def test_catalog_file_has_every_view_and_sees_new_partitions(tmp_path):
    run = tmp_path / "run"
    write_table(run, "scores", 1, [EXAMPLE_ROWS["scores"]])
    assert (run / "catalog.duckdb").is_file()
    con = duckdb.connect(str(run / "catalog.duckdb"), read_only=True)
    views = {
        name
        for (name,) in con.sql("select view_name from duckdb_views() where not internal").fetchall()
    }
    assert views == set(TABLES) | set(VIEWS)
    assert con.sql("select count(*) from evals").fetchall() == [(0,)]  # a view before any data
    assert con.sql("select count(*) from scores").fetchall() == [(1,)]
    con.close()
    write_table(run, "scores", 2, [EXAMPLE_ROWS["scores"]] * 2)
    write_table(run, "evals", 0, [EXAMPLE_ROWS["evals"]])
    catalog.ensure_catalog(run)  # a run's own writer rebuilds it while it writes (storage/background_writer.py)
    con = duckdb.connect(str(run / "catalog.duckdb"), read_only=True)
    assert con.sql("select step, count(*) from scores group by 1 order by 1").fetchall() == [
        (1, 1),
        (2, 2),
    ]
    assert con.sql("select count(*) from evals").fetchall() == [(1,)]
    con.close()


def test_catalog_works_from_the_duckdb_cli_elsewhere(tmp_path):
    """Views hold absolute paths: a process in another folder reads them."""
    run = tmp_path / "run"
    write_table(run, "groups", 1, [EXAMPLE_ROWS["groups"]])
    code = f"import duckdb; print(duckdb.connect({str(run / 'catalog.duckdb')!r}, read_only=True).sql('select count(*) from groups').fetchall())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[(1,)]"


def test_readers_over_several_runs(tmp_path):
    for run, n in (("a", 2), ("b", 3)):
        write_table(
            tmp_path / run,
            "advantages",
            1,
            [dict(sample_id=f"{run}{i}", group_id="g", advantage=1.0) for i in range(n)],
        )
    runs = [tmp_path / "a", tmp_path / "b"]
    rel = catalog.relation(runs, "advantages")
    assert sorted(rel.aggregate("run_id, count(*)").fetchall()) == [("a", 2), ("b", 3)]
    frame = catalog.lazy_frame(runs, "advantages").collect()
    assert sorted(frame["run_id"].to_list()) == ["a", "a", "b", "b", "b"]
    assert catalog.lazy_frame(runs, "scores").collect().columns == schema_for("scores").names
    assert catalog.connect(runs).sql("select count(*) from scores").fetchall() == [(0,)]
    with pytest.raises(ValueError, match="not a run directory"):
        catalog.connect([tmp_path / "a", tmp_path / "missing"])


def test_leftover_temporary_files_are_invisible_and_cleaned(tmp_path):
    write_table(tmp_path, "advantages", 1, [dict(sample_id="s", group_id="g", advantage=1.0)])
    folder = partition_file(tmp_path, "advantages", 1).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = folder / f".part-0.parquet.{dead.pid}.0123456789ab.tmp"
    leftover.write_bytes(b"PAR1 partial")
    assert catalog.connect(tmp_path).sql("select count(*) from advantages").fetchall() == [(1,)]
    mine = folder / f".part-0.parquet.{os.getpid()}.0123456789ab.tmp"  # a live writer's file stays
    mine.write_bytes(b"")
    write_table(tmp_path, "advantages", 1, [dict(sample_id="s", group_id="g", advantage=2.0)])
    assert not leftover.exists() and mine.exists()
    assert schema_file(tmp_path, "advantages").is_file()


def test_parallel_first_writes_of_a_fresh_run(tmp_path):
    """Stages in threads may write a run's first partitions at once (catalog creation races)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [dict(sample_id="s", group_id="g", advantage=1.0)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda step: write_table(tmp_path, "advantages", step, rows), range(8)))
    assert [
        step
        for (step,) in catalog.connect(tmp_path)
        .sql("select step from advantages order by 1")
        .fetchall()
    ] == list(range(8))
    con = duckdb.connect(str(tmp_path / "catalog.duckdb"), read_only=True)
    assert con.sql("select count(*) from advantages").fetchall() == [(8,)]
