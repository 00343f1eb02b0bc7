"""Lineage after a tiny SFT → RL pipeline with a real MLflow store (SQLite under the runs root):
registry tags, the `origins` table, `rlpipe lineage`, the canned query, and `rlpipe rescore` on the
RL run. The phases run as the pipeline flow runs them (run_supervised, then run_rl from its
checkpoint), without Prefect task runs: tests/integration/test_flows.py covers the flow itself."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MODEL = "lineage-test"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from rlpipe.flows.rl import run_rl
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    runs = tmp_path_factory.mktemp("lineage") / "runs"
    data = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    data |= {"runs_root": str(runs), "run_name": "lin"}
    data["sft"] |= {"steps": 6}
    data["rl"] |= {"steps": 2, "checkpoint_every": 1, "eval_every": 2}
    data["tracking"] |= {"registered_model": MODEL, "prefect_task_runs": False}
    config = validate_config(data)
    sft = run_supervised(config, "sft")
    run_rl(config, start_checkpoint=sft["checkpoint"])
    return runs


def _client(runs: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{runs / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_rl_versions_and_run_are_tagged_with_the_sft_version_they_started_from(pipeline):
    client = _client(pipeline)
    sft_checkpoint = str(pipeline / "lin" / "sft" / "checkpoints" / "step_000006")
    for number, step in (("1", "1"), ("2", "2")):
        tags = client.get_model_version(MODEL, number).tags
        assert tags["run_dir"] == str(pipeline / "lin" / "rl") and tags["step"] == step
        assert (tags["parent_model_name"], tags["parent_model_version"]) == (f"{MODEL}-sft", "1")
        assert tags["parent_checkpoint"] == sft_checkpoint
    rl_run = client.get_run(client.get_model_version(MODEL, "1").run_id)
    assert rl_run.data.tags["rlpipe.parent_checkpoint"] == sft_checkpoint
    assert rl_run.data.tags["rlpipe.parent_model_version"] == "1"


def test_lineage_lists_the_run_steps_and_rollouts_then_the_sft_version(pipeline, capsys):
    from rlpipe.storage.catalog import connect
    from rlpipe.storage.lineage import main

    rl_dir = pipeline / "lin" / "rl"
    trained = dict(connect([rl_dir]).sql("select step, count(*) from advantages group by 1").fetchall())
    assert main([f"models:/{MODEL}/1", "--runs-root", str(pipeline), "--format", "json"]) == 0
    chain = json.loads(capsys.readouterr().out)
    assert [entry["model"] for entry in chain] == [f"models:/{MODEL}/1", f"models:/{MODEL}-sft/1"]
    assert [(r["step"], r["samples"]) for r in chain[0]["trained_by_step"]] == [(1, trained[1])]
    assert chain[0]["train"]["steps"] == 1 and chain[1]["train"] == {**chain[1]["train"], "steps": 6, "mode": "sft"}
    assert len(chain[0]["samples"]) == 5 and all(s["trained_step"] == 1 for s in chain[0]["samples"])

    assert main([f"models:/{MODEL}@latest", "--runs-root", str(pipeline)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"models:/{MODEL}/2\n")
    assert f"rollouts     {connect([rl_dir]).sql('select count(*) from rollouts').fetchall()[0][0]} sampled, " \
           f"{trained[1] + trained[2]} trained" in text
    assert f"started from models:/{MODEL}-sft/1" in text and "6 sft step(s)" in text

    assert main([f"models:/{MODEL}/9", "--runs-root", str(pipeline)]) == 2
    assert "does not resolve" in capsys.readouterr().err


def test_canned_lineage_query_gives_the_same_from_the_tables(pipeline):
    from rlpipe.storage.catalog import connect, discover_runs
    from rlpipe.storage.queries import canned_sql

    labels = discover_runs(pipeline)
    assert sorted(labels.values()) == ["lin/rl", "lin/sft"]
    rows = connect(list(labels), labels=labels).sql(canned_sql("lineage_by_version")).to_arrow_table().to_pylist()
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {f"models:/{MODEL}/1", f"models:/{MODEL}/2", f"models:/{MODEL}-sft/1"}
    v2 = by_model[f"models:/{MODEL}/2"]
    assert v2["parent_model"] == f"models:/{MODEL}-sft/1" and v2["steps_trained"] == 2
    assert v2["samples_trained"] == connect([pipeline / "lin" / "rl"]).sql("select count(*) from advantages").fetchall()[0][0]
    assert by_model[f"models:/{MODEL}-sft/1"]["parent_model"] is None


def test_rescore_of_the_rl_run_with_another_reward(pipeline, tmp_path, monkeypatch, capsys):
    from rlpipe.flows.rescore import main
    from rlpipe.storage.catalog import connect

    (tmp_path / "lineage_rewards.py").write_text("def constant(text, answer, example):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rl_dir = pipeline / "lin" / "rl"
    assert main([str(rl_dir), "--reward", "lineage_rewards:constant"]) == 0
    out = rl_dir / "rescore" / "constant"
    con = connect([out])
    assert con.sql("select count(*), min(reward), max(reward) from scores").fetchall()[0][1:] == (1.0, 1.0)
    assert con.sql("select count(*) from advantages").fetchall()[0][0] == 0
    dropped = con.sql("select sum(samples_dropped), sum(samples_trained) from "
                      "(" + (Path(__file__).parents[2] / "dashboards" / "rescore_compare.sql").read_text() + ")").fetchall()[0]
    assert dropped[0] == dropped[1] > 0
