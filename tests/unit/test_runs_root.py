"""`rlpipe sql RUNS_ROOT`: every run below a folder in one catalog, told apart by a `run` column."""

from __future__ import annotations

import json

import pytest
from rlpipe.storage.catalog import connect, discover_runs
from rlpipe.storage.sqlcli import expand_runs, main
from rlpipe.storage.writer import write_table


def _scores(run_dir, run_id, rewards):
    for step, reward in enumerate(rewards, start=1):
        write_table(run_dir, "scores", step, [dict(run_id=run_id, step=step, sample_id=f"{run_id}:{step}",
                                                   group_id="g", reward=reward)], run_id=run_id)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    _scores(root / "demo" / "rl", "demo/rl", [0.25, 0.75])
    _scores(root / "other", "other", [1.0])
    (root / "demo" / "rl" / "checkpoints" / "step_000001" / "tables").mkdir(parents=True)  # not a run
    rescore = root / "demo" / "rl" / "rescore" / "x"
    _scores(rescore, "demo/rl", [9.0, 9.0])
    (rescore / "rescore.json").write_text(json.dumps({"source_run_dir": str(root / "demo" / "rl"),
                                                      "reward": "x", "tables": ["scores"]}))
    (root / "mlflow.db").write_text("")
    return root


def test_discover_runs_finds_nested_runs_but_not_rescore_folders(root):
    assert list(discover_runs(root).values()) == ["demo/rl", "other"]


def test_views_over_a_root_have_a_run_column_after_run_id(root):
    labels = discover_runs(root)
    con = connect(list(labels), labels=labels)
    assert con.sql("select * from scores limit 0").columns[:3] == ["run_id", "run", "step"]
    rows = con.sql("select run, count(*), sum(reward) from scores group by run order by run").fetchall()
    assert rows == [("demo/rl", 2, 1.0), ("other", 1, 1.0)]
    # a table no run has: an empty view that still has the column
    assert con.sql("select run, step from evals").fetchall() == []
    assert con.sql("select * from fates limit 0").columns[:2] == ["run_id", "run"]  # derived views too


def test_a_run_dir_given_itself_keeps_its_columns(root):
    runs, labels = expand_runs([str(root / "other")])
    assert labels is None
    assert "run" not in connect(runs).sql("select * from scores").columns


def test_cli_queries_a_runs_root(root, capsys):
    assert main([str(root), "select run, avg(reward) as r from scores group by run order by run", "-f", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"run","r"', '"demo/rl",0.5', '"other",1']
    assert main([str(root), "--query", "reward_by_step", "-f", "json"]) == 0
    assert {row["run_id"] for row in json.loads(capsys.readouterr().out)} == {"demo/rl", "other"}


def test_a_root_without_runs_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "select 1"]) == 2
    assert "no run folders (folders with tables/) under" in capsys.readouterr().err
