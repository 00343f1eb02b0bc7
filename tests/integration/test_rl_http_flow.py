"""The RL flow with two `rlpipe serve` subprocesses as its engines: every sync recorded and
applied; with one server killed, the next run stops with an error naming it and nothing
persisted is lost. The servers' token comes from the environment and is found nowhere in the
run directory, the MLflow store or the logs afterwards."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from rlpipe.engines.http import HttpEngine, HttpOptions
from rlpipe.engines.serve_process import serve_url, start_serve, stop_processes
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.storage.writer import read_table
from rlpipe.tasks.config import validate_config
from rlpipe.training.checkpoint_io import save_checkpoint

from tests import warm_cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prefect_api(prefect_in_process):
    """The flows run in this process against the session's Prefect server (conftest.py)."""
    yield


def http_config(tmp_path: Path, start: Path, urls: list[str], steps: int) -> dict:
    config = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    config.update(flow="rl", run_name="http", runs_root=str(tmp_path / "runs"))
    config["model"]["path"] = str(start)
    config["engine"] = {"type": "http", "urls": urls, "retries": 1, "timeout_s": 60}
    config["rl"].update(steps=steps, eval_every=0)
    config["rl"].setdefault("filter", {})["drop_zero_variance"] = False
    config["tracking"] = {"enabled": True, "report": False, "experiment": "http-secret"}
    return config


TOKEN = "tok-7f3a9c-never-on-disk"


def files_holding(root: Path, secret: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


def test_rl_flow_syncs_two_servers_and_stops_cleanly_when_one_dies(prefect_api, tmp_path, monkeypatch,
                                                                    capfd, caplog):
    from rlpipe.flows.rl import rl_flow

    monkeypatch.setenv("RLPIPE_API_TOKEN", TOKEN)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the store lands under runs_root (tmp)

    tok = build_tokenizer()
    start = save_checkpoint(tmp_path / "init", 0, build_model("tiny-dense", vocab_size=len(tok), seed=0), tok)
    procs: list[subprocess.Popen] = []
    try:
        procs = [start_serve(start, "--allow-root", str(tmp_path), token=TOKEN, popen=warm_cli.Popen)
                 for _ in range(2)]
        urls = [serve_url(p) for p in procs]
        rl_flow(config=http_config(tmp_path, start, urls, steps=2))

        run_dir = tmp_path / "runs" / "http"
        syncs = read_table(run_dir, "syncs").to_pylist()
        assert [(r["step"], r["ok"]) for r in syncs] == [(1, True), (1, True), (2, True), (2, True)]
        assert {r["engine"] for r in syncs} == set(urls)
        for url in urls:  # applied: each server now serves policy version 2
            engine = HttpEngine(url, HttpOptions(api_token=TOKEN))
            assert engine.health()["policy_version"] == 2
            engine.close()

        rollouts_before = read_table(run_dir, "rollouts").num_rows
        procs[1].kill()
        procs[1].wait(timeout=30)
        # the run, as if it had been a 3-step run stopped after step 2, resumed with a dead server
        longer = http_config(tmp_path, start, urls, steps=3)
        (run_dir / "config.json").write_text(json.dumps(validate_config(longer).model_dump(mode="json")))
        state = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**state, "status": "failed"}))
        with pytest.raises(Exception, match=urls[1].replace(".", r"\.")):
            rl_flow(config=longer, resume=True)
        assert read_table(run_dir, "rollouts", 1).num_rows + read_table(run_dir, "rollouts", 2).num_rows \
            == rollouts_before
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")) \
            == ["step_000001", "step_000002"]
        # the token reached the servers (every request above was authorised) and nothing else
        assert not files_holding(tmp_path, TOKEN.encode())
        out, err = capfd.readouterr()
        assert TOKEN not in out + err + caplog.text
        # config.json names the variable (engine.api_token_env, rl.distill.api_token_env), never its value
        named = [key for key, value in _leaves(json.loads((run_dir / "config.json").read_text()))
                 if "RLPIPE_API_TOKEN" in str(value)]
        assert named and all(key.endswith(".api_token_env") for key in named), named
    finally:
        stop_processes(procs)


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested config dict."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node
