"""configs/code.toml, shortened, through the pipeline flow: SFT on the teacher's solutions, then
RL whose rewards come from the hidden tests run in the sandbox. It needs the flow because the
point is the wiring: the score stage reaching the sandbox through the environment."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from rlpipe.envs import code, sandbox

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = sandbox.isolation_problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")]


def test_code_config_runs_and_scores_in_the_sandbox(tmp_path, monkeypatch, prefect_in_process):
    from rlpipe.envs.registry import build_env
    from rlpipe.flows.pipeline import pipeline_flow
    from rlpipe.storage.catalog import connect

    runs: list[str] = []

    def counted(source, **kwargs):
        runs.append(source)
        return sandbox.run_python(source, **kwargs)

    monkeypatch.setattr(code, "run_python", counted)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    config = tomllib.loads((ROOT / "configs" / "code.toml").read_text())
    config |= {"runs_root": str(tmp_path / "runs")}
    config["model"]["overrides"] = {"num_hidden_layers": 1}
    config["task"]["eval_examples"] = 4
    config["sft"] |= {"steps": 20, "examples": 640}
    config["rl"] |= {"steps": 2, "eval_every": 0, "checkpoint_every": 0, "prompts_per_step": 2, "group_size": 4}
    # one sampling round a step: 20 SFT steps leave every group's rewards equal, and each further
    # round (24 groups; tests/unit/test_advantages.py checks the rounds) is only more sandbox runs
    config["rl"]["buffer"] |= {"partial_batches": True, "max_attempts": 1}
    result = pipeline_flow(config=config)
    rl_dir = Path(result["run_dir"]) / "rl"
    with connect(rl_dir) as con:
        rows = con.sql("select r.example_id, r.completion_text, s.reward, s.components from rollouts r "
                       "join scores s using (sample_id) order by r.step, r.sample_id").fetchall()
        evals = con.sql("select count(*) from evals where step = 2").fetchall()[0][0]
    assert rows and evals == 4
    assert all({"passed", "defined", "timed_out"} <= set(dict(c)) for *_, c in rows)
    # every distinct scored completion ran in the sandbox (a round runs identical ones once), and its
    # stored reward is what the hidden tests give
    distinct = {(example_id, code.extract_code(text.replace("<|im_end|>", ""))) for example_id, text, *_ in rows}
    assert sum(source == code._HARNESS for source in runs) >= len(distinct)
    env = build_env("code", **config["task"]["options"])
    train = env.examples("train", seed=config["seed"])
    for example_id, text, reward, _ in rows[:8]:
        example = train[int(example_id.rsplit("/", 1)[1])]  # train/<seed>/<index>
        assert example.example_id == example_id
        answer = text.replace("<|im_end|>", "")
        assert env.reward(example, answer).reward == pytest.approx(reward), json.dumps(answer)
