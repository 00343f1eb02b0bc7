"""configs/gsm8k.toml end to end through `rlpipe run`, on a CPU stand-in of the same shape: the
config as shipped, with `--set` overrides pointing model.path at a tiny Qwen3 in a hub-layout
cache and a short run; `hf:openai/gsm8k:main` is a GSM8K-shaped repository in that cache. Under
HF_HUB_OFFLINE=1, as after a first download: nothing reaches the network."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import warm_cli
from tests.hub_cache import tiny_hub_gsm8k, tiny_hub_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gsm8k_config_runs_on_a_hub_model_and_a_hub_dataset(tmp_path, prefect_api_url, monkeypatch):
    from rlpipe.storage.catalog import connect
    from rlpipe.tasks.config import load_config

    hf_home = tmp_path / "hf"
    snapshot = tiny_hub_model(hf_home, "tiny-org/Tiny-Qwen3")
    tiny_hub_gsm8k(hf_home, train=24, test=6)
    shipped = load_config(ROOT / "configs" / "gsm8k.toml")
    assert shipped.model.path == "Qwen/Qwen3-0.6B" and shipped.engine.type == "auto"
    assert shipped.task.options["path"] == "hf:openai/gsm8k:main" and shipped.task.options["reward"] == "math"

    # HF_HOME is read when huggingface_hub is imported: set here too, the run and the replay below
    # fork from a warm zygote of their own that has it (tests/warm_cli.py), not from cold starts
    monkeypatch.setenv("HF_HOME", str(hf_home))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               RLPIPE_PROGRESS="0", PREFECT_API_URL=prefect_api_url, PREFECT_API_REQUEST_TIMEOUT="120")
    overrides = {"model.path": "tiny-org/Tiny-Qwen3", "runs_root": str(tmp_path / "runs"), "threads": "1",
                 "device": "cpu", "model.bf16_autocast": "false", "rl.steps": "2", "rl.prompts_per_step": "4",
                 "rl.group_size": "4", "rl.sampling.max_new_tokens": "8", "rl.eval_every": "2",
                 "rl.checkpoint_every": "2", "task.eval_examples": "4", "rl.optim.token_budget": "2048",
                 "tracking.report": "false"}
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    done = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "gsm8k.toml"),
                           *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run = tmp_path / "runs" / "gsm8k"
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    con = connect([run])
    origin = con.execute("select parent_checkpoint from origins").fetchall()
    assert origin == [(f"tiny-org/Tiny-Qwen3@{snapshot.name}",)]  # where the run started: hub id + commit
    prompts = [row[0] for row in con.execute("select distinct prompt_text from rollouts").fetchall()]
    assert prompts and all("after \"####\"" in text and "<|im_start|>user" in text for text in prompts)
    scored, errors, graded = con.execute(
        "select count(*), count(error), count(components['correct']) from scores").fetchone()
    assert scored >= 2 * 4 * 4 and errors == 0 and graded == scored  # every completion graded by `math`
    assert sorted(step for (step,) in con.execute("select distinct step from evals").fetchall()) == [0, 2]
    from mlflow import MlflowClient

    versions = MlflowClient(env["MLFLOW_TRACKING_URI"]).search_model_versions("name = 'rlpipe-gsm8k'")
    assert versions and all(v.tags.get("parent_checkpoint") == origin[0][0] for v in versions)
    checkpoint = run / "checkpoints" / "step_000002"
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == AutoTokenizer.from_pretrained(snapshot).chat_template

    # replay finds the starting weights by the recorded hub id and commit, bit for bit
    replay = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "replay", str(run), "--step", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    assert f"tiny-org/Tiny-Qwen3@{snapshot.name}" in replay.stdout + replay.stderr
