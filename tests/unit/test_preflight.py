"""Config and input errors refused before anything is written: one line naming the key, exit 2,
no run folder, no MLflow database, no resume advice (tasks/preflight.py, flows/runner.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from rlpipe.core.config import ConfigError
from rlpipe.flows.cli import main
from rlpipe.tasks.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A clean working folder and a tracking URI under tmp_path, so any write would show."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'tracking.db'}")
    return tmp_path


def nothing_written(where: Path) -> bool:
    """No runs_root, no tracking database, no ./mlruns: nothing at all in the working folder
    besides what the test put there."""
    return all(p.name.startswith("given") for p in where.iterdir())


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI in process; assert exit 2 and exactly one stderr line; return it."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, err)
    assert "`rlpipe resume" not in err  # no resume advice: nothing was persisted
    return lines[0]


def given_file(where: Path, name: str, data: bytes) -> Path:
    path = where / f"given_{name}"
    path.write_bytes(data)
    return path


CASES = {
    "model.preset": (["model.preset=nope"], "unknown preset 'nope'"),
    "task.env": (["task.env=nope"], "unknown environment 'nope'"),
    "task.options": (["task.options.bogus=1"], "bogus"),
    "task.options-value": (["task.options.max_digits=0"], "max_digits=0"),
    "model.path": (["model.path=given_missing_model"], "does not exist"),
    "model.overrides": (["model.overrides.bogus=1"], "bogus"),
    "sft.data_path": (["sft.data_path=given_missing.jsonl"], "does not exist"),
    "rl.filter.sample_filter": (["rl.filter.sample_filter=given_nomod:fn"], "No module named 'given_nomod'"),
    "rl.sampling.top_p": (["rl.sampling.top_p=2"], "must be <= 1"),
    "rl.loss.type": (["rl.loss.type=nope"], "must be 'reinforce'"),
    "run_name": (["run_name=a\udcffb"], "not valid UTF-8"),
    "engine.type": (["engine.type=vllm"], "needs vLLM"),
    "runs_root": (["runs_root=given\udcff"], "not valid UTF-8"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_bad_setting_is_one_line_exit_2_and_nothing_written(where, capsys, name):
    overrides, says = CASES[name]
    if name == "engine.type" and find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: its absence cannot be refused")
    argv = ["run", str(TINY), "--set", "runs_root=runs"]
    for override in overrides:
        argv += ["--set", override]
    line = refused(capsys, argv)
    key = name.split("-")[0]
    assert key in line and says in line, line
    assert nothing_written(where), sorted(p.name for p in where.iterdir())


def test_an_empty_model_folder_names_what_it_lacks(where, capsys):
    (where / "given_model").mkdir()
    line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", "--set", "model.path=given_model"])
    assert line.startswith("rlpipe run: model.path:") and "no config.json" in line
    assert nothing_written(where)


def test_a_dataset_env_with_a_missing_file_or_reward_module_is_refused(where, capsys):
    data = given_file(where, "data.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n')
    for options, says in [(f'{{path="{where / "given_nope.jsonl"}"}}', "given_nope.jsonl"),
                          (f'{{path="{data}", reward="nope"}}', "nope"),
                          (f'{{path="{data}", reward_module="given_nomod"}}', "given_nomod")]:
        line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", "--set", "task.env=dataset",
                                "--set", f"task.options={options}"])
        assert "task.options" in line and says in line, line
    assert nothing_written(where)


def test_a_missing_pretrain_corpus_is_refused_for_the_pretrain_flow(where, capsys):
    line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", "--set", "flow=pretrain",
                            "--set", "pretrain.steps=1", "--set", "pretrain.data_path=given_none.txt"])
    assert line.startswith("rlpipe run: pretrain.data_path:") and "given_none.txt" in line
    assert nothing_written(where)


def test_a_config_file_that_is_not_utf8_names_the_file(where, capsys):
    path = given_file(where, "bad.toml", b'run_name = "caf\xe9"\n')
    line = refused(capsys, ["run", str(path)])
    assert str(path) in line and "not UTF-8" in line
    assert nothing_written(where)


def test_resume_refuses_a_run_whose_inputs_went_missing_without_writing(where, capsys):
    run_dir = where / "given_run"
    run_dir.mkdir()
    config = load_config(TINY, [f"runs_root={where}", "run_name=given_run"]).model_dump(mode="json")
    config["sft"]["data_path"] = str(where / "given_gone.jsonl")
    (run_dir / "config.json").write_text(json.dumps(config))
    line = refused(capsys, ["resume", str(run_dir)])
    assert line.startswith("rlpipe resume: sft.data_path:")
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json"]


def test_a_flow_given_bad_parameters_refuses_them_before_opening_its_run(where):
    # what a deployment's flow run does first (flows/common.py resolve_config)
    from rlpipe.flows.common import resolve_config

    dumped = load_config(TINY, ["runs_root=runs"]).model_dump(mode="json")
    with pytest.raises(ConfigError, match=r"^task\.env: unknown environment 'nope'"):
        resolve_config(None, ["task.env=nope"], dumped)
    with pytest.raises(ConfigError, match=r"^model\.preset: unknown preset"):
        resolve_config(str(TINY), ["runs_root=runs", "model.preset=nope"], None)
    assert nothing_written(where)


@pytest.mark.slow
def test_the_real_cli_refuses_with_one_line_in_a_subprocess(tmp_path):
    # the installed entry point, argv as bytes the way a shell passes a non-UTF-8 name
    for setting, says in [(b"run_name=a\xffb", "run_name is not valid UTF-8"),
                          (b"task.env=nope", "task.env: unknown environment 'nope'")]:
        out = subprocess.run([sys.executable, "-m", "rlpipe.flows.cli", "run", str(TINY), "--set",
                              f"runs_root={tmp_path / 'runs'}", "--set", setting],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300,
                             env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 't.db'}"})
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and says in lines[0], out.stderr
        assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("stop", [RuntimeError("boom"), KeyboardInterrupt()])
def test_resume_advice_only_where_the_run_folder_holds_a_run(where, capsys, monkeypatch, stop):
    from rlpipe.flows import runner

    def fails(config):
        raise stop

    monkeypatch.setattr(runner, "start", fails)
    config = load_config(TINY, [f"runs_root={where / 'given_runs'}"])
    runner._execute_flow(config, overwrite=False)
    assert "rlpipe resume" not in capsys.readouterr().err  # failed before run.json: nothing to resume
    (config.run_dir / "run.json").write_text("{}")
    runner._execute_flow(config, overwrite=False)
    assert f"`rlpipe resume {config.run_dir}` continues" in capsys.readouterr().err
