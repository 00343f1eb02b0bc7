"""configs/multiturn.toml, shortened, through the pipeline flow: SFT on whole tool-use episodes,
then multi-turn RL whose tables record every turn."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_multiturn_config_runs_and_records_turns(tmp_path, monkeypatch, prefect_in_process):
    from rlpipe.flows.pipeline import pipeline_flow
    from rlpipe.storage.catalog import connect

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    config = tomllib.loads((ROOT / "configs" / "multiturn.toml").read_text())
    config |= {"runs_root": str(tmp_path / "runs")}
    config["model"]["overrides"] = {"num_hidden_layers": 1}
    config["task"]["eval_examples"] = 8
    config["sft"] |= {"steps": 20, "examples": 640}
    config["rl"] |= {"steps": 2, "eval_every": 0, "checkpoint_every": 0, "prompts_per_step": 2, "group_size": 4}
    config["rl"]["buffer"]["partial_batches"] = True
    result = pipeline_flow(config=config)
    rl_dir = Path(result["run_dir"]) / "rl"
    with connect(rl_dir) as con:
        rows = con.sql("select n_turns, len(turns), finish_reason, messages from rollouts").fetchall()
        assert rows and all(n >= 1 and spans >= n for n, spans, _, _ in rows)
        assert {r[2] for r in rows} <= {"stop", "length", "max_turns"}
        # environment spans never carry loss: the sampled spans hold every model token
        producers = dict(con.sql("select t.producer, sum(t.length) from (select unnest(turns) t from rollouts) "
                                 "group by all").fetchall())
        total = con.sql("select sum(n_completion_tokens) from rollouts").fetchall()[0][0]
        assert producers["model"] + producers.get("env", 0) == total
        components = con.sql("select distinct unnest(map_keys(components)) from scores").fetchall()
        assert {"correct", "tool_calls"} <= {c for (c,) in components}
        assert con.sql("select count(*) from evals where step = 2").fetchall()[0][0] == 8
