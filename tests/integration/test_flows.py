"""Each flow for a few steps in this process, against the session's Prefect server (conftest.py):
tables, task runs, MLflow, registry."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_api(prefect_in_process):
    """The flows run in this process against the session's Prefect server (conftest.py)."""
    yield


def tiny_config(tmp_path: Path, **changes) -> dict:
    config = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    config["runs_root"] = str(tmp_path / "runs")
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def table_steps(run_dir: Path, table: str) -> list[int]:
    folder = run_dir / "tables" / table
    return sorted(int(p.name.split("=")[1]) for p in folder.glob("step=*") if any(p.glob("*.parquet")))


def test_pipeline_runs_sft_then_rl_and_records_everything(prefect_api, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient
    from rlpipe.flows.pipeline import pipeline_flow
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    config = tiny_config(tmp_path, tracking__registered_model="tiny-test")
    result = pipeline_flow(config=config)

    rl_dir = Path(result["run_dir"]) / "rl"
    sft_dir = Path(result["run_dir"]) / "sft"
    steps = config["rl"]["steps"]
    for table in ("rollouts", "scores", "groups", "advantages", "batches", "train_steps"):
        assert table_steps(rl_dir, table) == list(range(1, steps + 1)), table
    assert table_steps(rl_dir, "evals") == [0, 2, 4]
    assert table_steps(rl_dir, "checkpoints") == [2, 4]
    assert table_steps(sft_dir, "train_steps") == list(range(1, config["sft"]["steps"] + 1))

    # the RL run starts from the SFT checkpoint: step-0 eval equals SFT's final eval
    from rlpipe.storage.writer import read_table

    sft_final = read_table(sft_dir, "evals", config["sft"]["steps"]).to_pylist()
    rl_start = read_table(rl_dir, "evals", 0).to_pylist()
    assert [r["completion_text"] for r in sft_final] == [r["completion_text"] for r in rl_start]

    # checkpoints load with plain transformers
    model = AutoModelForCausalLM.from_pretrained(result["rl"]["checkpoint"])
    assert model.config.vocab_size > 10

    # MLflow: nested runs with metrics; checkpoints registered as versions
    client = MlflowClient()
    versions = client.search_model_versions("name='tiny-test'")
    assert len(versions) == 2  # RL steps 2 and 4
    assert {v.tags["step"] for v in versions} == {"2", "4"}
    downloaded = mlflow.artifacts.download_artifacts("models:/tiny-test@latest")
    assert (Path(downloaded) / "config.json").is_file()
    runs = mlflow.search_runs(experiment_names=[config["tracking"]["experiment"]], output_format="list")
    by_phase = {r.data.tags.get("rlpipe.phase"): r for r in runs}
    assert {"pipeline", "sft", "rl"} <= set(by_phase)
    rl_metrics = by_phase["rl"].data.metrics
    for name in ("train/loss", "rollout/reward_mean", "rollout/zero_var_fraction", "perf/seconds_generate",
                 "eval/accuracy"):
        assert name in rl_metrics, name
    assert by_phase["rl"].data.tags.get("mlflow.parentRunId") == by_phase["pipeline"].info.run_id


def test_best_alias_follows_the_best_checkpointed_sft_eval_and_latest_is_the_newest(prefect_api, tmp_path,
                                                                                     monkeypatch):
    """An SFT run whose eval improves: `NAME-sft@best` is the checkpoint with the highest eval
    accuracy (the first of equals), `NAME-sft@latest` the last checkpoint. On the tiny task the
    accuracy goes 0 → 0.05 at step 20, back to 0, 0.05 again at 30: an alias that followed every
    checkpoint, or moved on equal accuracy, would name step 30."""
    import duckdb
    from mlflow import MlflowClient
    from rlpipe.flows.sft import sft_flow
    from rlpipe.storage.model_versions import resolve_model_version
    from rlpipe.storage.writer import read_table

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path, flow="sft", tracking__registered_model="best-test", sft__eval_every=5, sft__steps=30,
                         sft__checkpoint_every=5)
    sft_flow(config=config)
    evals = read_table(Path(config["runs_root"]) / config["run_name"], "evals")  # noqa: F841 (read by duckdb)
    accuracy = dict(duckdb.sql("select step, avg(correct::int) from evals group by step order by step").fetchall())
    assert sorted(accuracy) == list(range(5, 35, 5))
    best_step = max(sorted(accuracy), key=lambda s: (accuracy[s], -s))
    assert accuracy[best_step] > accuracy[5], f"the eval never improved, nothing to check: {accuracy}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert resolve_model_version(client, "models:/best-test-sft@best").tags["step"] == str(best_step), accuracy
    assert resolve_model_version(client, "models:/best-test-sft@latest").tags["step"] == "30"


def test_an_rl_run_that_trains_nothing_warns_each_step_and_registers_nothing(prefect_api, tmp_path, monkeypatch,
                                                                           capfd):
    """A fresh preset never answers right, and the reward gives nothing for the format: every group
    has zero variance and partial batches train on none. Each step prints a warning line, the
    progress line says 0 of N, the result says nothing trained, and no checkpoint is registered."""
    from mlflow import MlflowClient
    from rlpipe.flows.rl import rl_flow
    from rlpipe.storage.stage_tables import load_rows

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLPIPE_PROGRESS", "1")  # the tests' default hides progress bars
    config = tiny_config(tmp_path, flow="rl", run_name="untrained", tracking__registered_model="untrained",
                         rl__steps=2, rl__eval_every=2, rl__checkpoint_every=1,
                         rl__buffer={"oversample_factor": 1.0, "max_attempts": 1, "partial_batches": True})
    result = rl_flow(config=config)
    assert result["trained"] is False
    err = capfd.readouterr().err
    for step in (1, 2):
        assert f"rlpipe: warning: RL step {step} trained on no sample, its weights are unchanged" in err
    assert "trained=0% of 32" in err  # the progress line: 4 groups of 8, none trained
    assert MlflowClient().search_model_versions("name='untrained'") == []
    run_dir = tmp_path / "runs" / "untrained"
    assert [load_rows(run_dir, "checkpoints", s)[0]["mlflow_model_version"] for s in (1, 2)] == [None, None]


def test_stages_are_named_task_runs_unless_turned_off(prefect_api, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from rlpipe.flows.sft import sft_flow
    from rlpipe.storage.writer import read_table

    def task_names(flow_run_id) -> list[str]:
        async def read():
            async with get_client() as client:
                runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                return sorted({r.name.rsplit("-", 1)[0] for r in runs})

        return asyncio.run(read())

    names = {}
    for task_runs in (True, False):
        config = tiny_config(tmp_path / str(task_runs), flow="sft", tracking__enabled=False, sft__steps=3,
                             tracking__prefect_task_runs=task_runs)
        state = sft_flow(config=config, return_state=True)
        assert state.is_completed()
        names[task_runs] = task_names(state.state_details.flow_run_id)
        run_dir = Path(config["runs_root"]) / config["run_name"]
        assert read_table(run_dir, "train_steps").num_rows == 3  # the stages ran either way
    assert "train" in names[True] and "checkpoint" in names[True] and "eval" in names[True]
    assert names[False] == []  # plain calls inside the flow run


def test_pretrain_flow_lowers_loss(prefect_api, tmp_path):
    from rlpipe.flows.pretrain import pretrain_flow
    from rlpipe.storage.writer import read_table

    config = tiny_config(tmp_path, flow="pretrain", tracking__enabled=False,
                         pretrain__steps=12, pretrain__seq_len=64, pretrain__sequences_per_step=16,
                         pretrain__examples=500, pretrain__optim={"lr": 5e-3, "warmup_steps": 1})
    result = pretrain_flow(config=config)
    losses = [r["loss"] for r in read_table(Path(config["runs_root"]) / "tiny", "train_steps").to_pylist()]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert Path(result["checkpoint"]).is_dir()


def test_bad_inputs_fail_with_the_culprit_named(prefect_api, tmp_path):
    from rlpipe.flows.rl import rl_flow
    from rlpipe.flows.sft import sft_flow

    missing = tiny_config(tmp_path, flow="sft", tracking__enabled=False, sft__data_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(Exception, match="nope.jsonl"):
        sft_flow(config=missing)
    long_prompt = tiny_config(tmp_path, flow="rl", run_name="long", tracking__enabled=False,
                              model__overrides={"max_position_embeddings": 8})
    with pytest.raises(Exception, match="exceeds the model context"):
        rl_flow(config=long_prompt)
