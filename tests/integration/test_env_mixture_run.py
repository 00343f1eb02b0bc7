"""A mixture of two built-in environments (`[[task.envs]]`: arithmetic and countdown) through the
RL flow, 2 steps from a fresh tiny preset. It needs the flow: what it checks is how the pieces
meet in one run (the setup builds the mixture, generate writes env= partitions, the source logs
per-environment metrics, the catalog's views, canned queries and the report read it all back)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.leftovers import strays

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def mixture_config(runs_root: Path) -> dict:
    config = tomllib.loads((ROOT / "configs" / "rl.toml").read_text())
    config.update(runs_root=str(runs_root), run_name="mix", threads=1)
    config["task"] = {"eval_examples": 8, "envs": [
        {"name": "add", "weight": 3, "env": "arithmetic",
         "options": {"min_digits": 1, "max_digits": 1, "operators": "+", "eval_size": 20}},
        {"name": "cd", "weight": 1, "env": "countdown",
         "options": {"min_numbers": 3, "max_numbers": 3, "max_number": 9, "max_target": 20, "eval_size": 20}}]}
    config["tracking"] = {"enabled": False, "report": False, "prefect_task_runs": False}
    config["rl"] = {**config["rl"], "steps": 2, "prompts_per_step": 8, "group_size": 4, "eval_every": 2,
                    "checkpoint_every": 1}
    config["rl"]["buffer"] = {**config["rl"]["buffer"], "oversample_factor": 1.0, "max_attempts": 1}
    return config


def test_a_mixture_run_partitions_its_rollouts_by_env_and_reports_each_env(tmp_path, monkeypatch):
    import rlpipe.flows.rl
    from rlpipe.dashboards.report import report_data
    from rlpipe.envs.mixture import prompt_source
    from rlpipe.storage.catalog import connect
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.tracking import NullTracker
    from rlpipe.tasks.config import validate_config
    from rlpipe.tasks.setup import task_env

    tracker = NullTracker()
    monkeypatch.setattr(rlpipe.flows.rl, "make_tracker", lambda *args, **kwargs: tracker)
    config = validate_config(mixture_config(tmp_path))
    result = rlpipe.flows.rl.run_rl(config)
    run_dir = config.run_dir

    # rows of both environments, each in its own env= folder inside the step
    con = connect([run_dir])
    by_env = dict(con.sql("select env, count(*) from rollouts group by env").fetchall())
    assert set(by_env) == {"add", "cd"} and by_env["add"] > by_env["cd"] > 0
    for step in (1, 2):
        folder = run_dir / "tables" / "rollouts" / f"step={step}"
        assert not (folder / "part-0.parquet").exists()
        on_disk = {p.parent.name: p for p in folder.glob("env=*/part-0.parquet")}
        assert set(on_disk) == {"env=add", "env=cd"}
        assert set(pq.read_table(on_disk["env=cd"], columns=["env"]).column(0).to_pylist()) == {"cd"}
    assert strays(run_dir / "tables") == []  # nothing but partitions, schema files and the mark
    # groups keyed by environment, ids unique across entries; every sample has one fate
    def one(sql: str):
        return con.sql(sql).fetchall()[0][0]

    assert one("select count(*) from groups where not starts_with(example_id, env || '/')") == 0
    assert one("select count(*) from rollouts") == one("select count(*) from fates where status is not null")

    # per-environment metrics, logged each step and equal to the canned query's numbers
    logged = {}
    for step, metrics in tracker.metrics:
        logged.setdefault(step, {}).update(metrics)
    rows = {(r["env"], r["step"]): r for r in run_canned([run_dir], "env_by_step").to_pylist()}
    for step in (1, 2):
        for env in ("add", "cd"):
            assert logged[step][f"rollout/{env}/samples"] == rows[(env, step)]["n_samples"]
            assert logged[step][f"rollout/{env}/reward_mean"] == pytest.approx(rows[(env, step)]["reward_mean"])
            assert logged[step][f"rollout/{env}/accuracy"] == pytest.approx(rows[(env, step)]["accuracy"])
            assert 0 <= logged[step][f"rollout/{env}/zero_var_fraction"] <= 1
    assert {"eval/add/accuracy", "eval/cd/accuracy"} <= set(result["eval"])
    assert run_canned([run_dir], "zero_variance_by_step").num_rows == 2

    # step 1's checkpoint holds the draw's position: a source resumed from it deals step 2's prompts
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "data_state.json").read_text())
    assert state["prompts"]["mixture"]["names"] == ["add", "cd"] and state["prompts"]["mixture"]["drawn"] == 8
    resumed = prompt_source(task_env(config.task), config.seed)
    resumed.load_state_dict(state["prompts"])
    sampled = con.sql("select any_value(env), any_value(example_id) from rollouts where step = 2 "
                      "group by group_id order by group_id").fetchall()
    assert [(e.env, e.example_id) for e in resumed.next_batch(len(sampled))] == sampled
    # the report has a row per environment
    assert [(r["env"], r["steps"]) for r in report_data([run_dir])["environments"]["rows"]] == [("add", 2), ("cd", 2)]
