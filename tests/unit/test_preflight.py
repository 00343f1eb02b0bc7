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


# ---- values refused too late before ----

def given_config(where: Path, name: str, extra: str) -> Path:
    """tiny.toml with `extra` TOML appended (its tables after tiny's own)."""
    return given_file(where, name, (TINY.read_text() + "\n" + extra).encode())


MIXTURE = """
[[task.envs]]
name = "a"
weight = {a}
env = "arithmetic"
options = {{ max_digits = 1, eval_size = 5 }}

[[task.envs]]
name = "b"
weight = {b}
env = "arithmetic"
options = {{ max_digits = 2, eval_size = 5 }}
"""


@pytest.mark.parametrize(("a", "b", "says"), [
    ("1e308", "1e308", "task.envs: the weights sum to inf"),
    ("inf", "1", "task.envs.0.weight must be a finite number"),
    ("nan", "1", "task.envs.0.weight must be a finite number"),
    ("1e-320", "1e300", "of entry 'a' is 0 of the sum 1e+300, so it would never be drawn"),
])
def test_mixture_weights_whose_shares_are_not_finite_are_refused(where, capsys, a, b, says):
    tiny = TINY.read_text().replace('env = "arithmetic"\noptions = { min_digits = 1, max_digits = 1, '
                                    'operators = "+", eval_size = 20 }\n', "")
    path = given_file(where, "mix.toml", (tiny + MIXTURE.format(a=a, b=b)).encode())
    line = refused(capsys, ["run", str(path), "--set", "runs_root=runs"])
    assert says in line, line
    assert nothing_written(where), sorted(p.name for p in where.iterdir())


def test_sft_data_weights_that_overflow_and_empty_sources_are_refused(where, capsys):
    chat = b'{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}\n'
    full = given_file(where, "full.jsonl", chat)
    empty = given_file(where, "empty.jsonl", b"")
    blank = given_file(where, "blank.jsonl", b"\n\n")
    for sources, says in [
        ([(full, "1e308"), (full, "1e308")], "sft.data: the weights sum to inf"),
        ([(full, "1"), (empty, "1")], f"sft.data: SFT data file {empty} holds no conversations"),
        ([(blank, "1")], f"sft.data: SFT data file {blank} holds no conversations"),
    ]:
        extra = "".join(f'\n[[sft.data]]\npath = "{path}"\nweight = {weight}\n' for path, weight in sources)
        line = refused(capsys, ["run", str(given_config(where, "sft.toml", extra)), "--set", "runs_root=runs"])
        assert says in line, line
    for setting in ("sft.data_path", "pretrain.data_path"):
        flow = ["--set", "flow=pretrain", "--set", "pretrain.steps=1"] if setting.startswith("pretrain") else []
        line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", *flow, "--set", f"{setting}={empty}"])
        assert line.startswith(f"rlpipe run: {setting}:") and "holds no" in line, line
    assert nothing_written(where), sorted(p.name for p in where.iterdir())


def test_reward_weights_must_be_finite(where, capsys):
    line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", "--set", "task.env_reward_weight=inf"])
    assert "task.env_reward_weight" in line and "finite" in line
    assert nothing_written(where)


def test_a_batch_maker_that_fails_on_its_first_groups_is_refused_before_the_run(where, capsys, monkeypatch):
    (where / "given_makers.py").write_text(
        "class AddRaises:\n    def __init__(self, options): pass\n"
        "    def add(self, groups): raise ValueError('no room')\n"
        "    def create_batch(self, size): return None\n    def metadata(self, batch): return {}\n"
        "    def state_dict(self): return {}\n    def load_state_dict(self, state): pass\n"
        "class Ids(AddRaises):\n    held = []\n    def add(self, groups): self.held = list(groups)\n"
        "    def create_batch(self, size): return [g.group_id for g in self.held[:size]] if len(self.held) >= size else None\n"
        "class Unsaveable(Ids):\n    def create_batch(self, size): return None\n"
        "    def state_dict(self): return {'groups': self.held}\n"
        "class BadInit(AddRaises):\n    def __init__(self, options): raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(where))
    for name, says in [("AddRaises", "batch maker given_makers:AddRaises: add raised ValueError: no room"),
                       ("Ids", "batch maker given_makers:Ids: create_batch(4) returned 'preflight-0' (a str)"),
                       ("Unsaveable", "state_dict is not plain JSON"),
                       ("BadInit", "batch maker given_makers:BadInit: its constructor raised RuntimeError: needs a GPU")]:
        line = refused(capsys, ["run", str(TINY), "--set", "runs_root=runs", "--set",
                                f"rl.buffer.batch_maker=given_makers:{name}"])
        assert line.startswith("rlpipe run: rl.buffer.batch_maker: ") and says in line, line
    assert nothing_written(where), sorted(p.name for p in where.iterdir())
