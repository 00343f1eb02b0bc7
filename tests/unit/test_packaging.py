"""What `pip install rlpipe` puts on a user's machine: one import package, `rlpipe`, whose
subpackages are the repository's layer folders (pyproject's package-dir), so a user's own
`models.py`, `training/` or `tasks/` never collides with ours, and the user's own reward or
filter modules are found in the working directory however rlpipe was started."""

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from rlpipe.core.config import describe_fields
from rlpipe.core.user_code import import_user_object
from rlpipe.tasks.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = {"tests", "benchmarks"}
SCRIPT = Path(sys.executable).parent / "rlpipe"


def test_every_layer_folder_is_installed_under_rlpipe():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - NOT_SHIPPED
    assert listed == {f"rlpipe.{name}" for name in on_disk}, "every layer folder is listed as rlpipe.<folder>"
    assert setuptools["package-dir"] == {f"rlpipe.{name}": name for name in on_disk}


@pytest.mark.slow
def test_the_wheel_holds_rlpipe_alone(tmp_path):
    # built from a copy: setuptools writes build/ into the tree it builds
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "runs", "mlruns", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("rlpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"rlpipe", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "rlpipe/dashboards/report.html" in names and "rlpipe/flows/cli.py" in names


@pytest.mark.slow
def test_a_users_own_models_and_tasks_do_not_shadow_rlpipe(tmp_path):
    for name in ("models", "training", "tasks", "flows", "storage"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the user module was imported')\n")
    (tmp_path / "engines.py").write_text("raise ImportError('the user module was imported')\n")
    env = {**os.environ, "PYTHONPATH": ""}
    # `python -m` puts the working directory first on sys.path, as torchrun's ranks do
    for command in ([str(SCRIPT)], [sys.executable, "-m", "rlpipe.flows.cli"]):
        done = subprocess.run([*command, "run", "--help-config"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "\n".join(describe_fields(RunConfig)) + "\n"  # every key with its doc


def test_user_objects_come_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text("def reward(text, answer, example):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert import_user_object("my_rewards_mod:reward", "--reward")("", "", None) == 1.0
    with pytest.raises(ValueError, match=r"--reward 'my_rewards_mod:nope'.*no attribute 'nope'"):
        import_user_object("my_rewards_mod:nope", "--reward")
    with pytest.raises(ValueError, match=r"rl.filter.sample_filter 'absent_mod_xyz:f': cannot import"):
        import_user_object("absent_mod_xyz:f", "rl.filter.sample_filter")
    with pytest.raises(ValueError, match="must be 'module:attribute'"):
        import_user_object("no_colon", "rl.filter.sample_filter")
