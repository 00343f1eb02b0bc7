"""A run folder acts as itself wherever it lies, a finished run is left as it is, and what each
command imports from a run folder — all through the real CLI (`rlpipe run/resume/sql/replay/
report/lineage/rescore`) on the tiny pipeline.

One run is SIGKILLed in its RL phase; its folder is copied elsewhere and the original moved
away (its path gone), and the copy resumes, queries and replays as itself."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest

from tests import warm_cli
from tests.integration.test_resume import ONE_THREAD, ROOT, cli, env_for

pytestmark = pytest.mark.slow


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` (the lock file aside) → its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def rlpipe(*args: str, env: dict, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    return warm_cli.run(cli(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def killed_in_rl(runs: Path, name: str, env: dict) -> Path:
    """A tiny pipeline run SIGKILLed once RL step 3 is trained (last checkpoint: step 2): once the
    table's snapshot names the step, not once its file is on disk (the file comes first, so a kill
    between the two would leave step 3 unwritten)."""
    from rlpipe.storage.writer import is_complete

    run_dir = runs / name
    # a 4-step SFT phase: RL's step 2 then evals better than its start, so the copy's resume meets
    # a stored best whose registered version is the original's
    process = warm_cli.Popen(cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}",
                                   "--set", f"run_name={name}", "--set", "sft.steps=4", *ONE_THREAD),
                             env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not is_complete(run_dir / "rl", "train_steps", 3):
            assert process.poll() is None, "the run ended before the kill point"
            assert time.monotonic() < deadline, "kill point not reached"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
    return run_dir


def steps(run_dir: Path, table: str = "train_steps") -> list[int]:
    from rlpipe.storage.writer import read_table

    return sorted(read_table(run_dir, table).column("step").to_pylist())


def test_a_copied_run_resumes_queries_and_replays_as_itself(tmp_path, prefect_api_url):
    env = env_for(tmp_path, prefect_api_url)
    runs = tmp_path / "runs"
    original = killed_in_rl(runs, "orig", env)
    assert steps(original / "rl") == [1, 2, 3]
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(original, copy)
    gone = tmp_path / "moved-away"
    original.rename(gone)  # the path the copy's config.json names no longer exists
    before = digest(gone)

    resumed = rlpipe("resume", str(copy), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(copy / "rl") == [1, 2, 3, 4]
    assert json.loads((copy / "config.json").read_text())["runs_root"] == str(copy.parent)
    assert json.loads((copy / "rl" / "run.json").read_text())["run_dir"] == str(copy / "rl")
    assert not original.exists()  # no fresh run started at the old path
    assert digest(gone) == before  # the original is untouched

    # the copy's catalog, opened with plain DuckDB, reads the copy's files
    con = duckdb.connect(str(copy / "rl" / "catalog.duckdb"), read_only=True)
    view = con.execute("select sql from duckdb_views() where view_name = 'rollouts'").fetchone()[0]
    assert str(copy / "rl" / "tables") in view and str(gone) not in view
    assert con.execute("select distinct step from train_steps order by step").fetchall() == [(1,), (2,), (3,), (4,)]
    con.close()

    # a finished run is left as it is: one line, exit 0, nothing rewritten
    finished = digest(copy)
    for folder in (copy, copy / "rl"):
        again = rlpipe("resume", str(folder), env=env)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "already finished" in again.stdout and len(again.stdout.strip().splitlines()) == 1
    assert digest(copy) == finished

    # a second copy, never resumed, queried and replayed where it lies (the first one moved away)
    second = tmp_path / "third" / "copy2"
    shutil.copytree(copy, second)
    copy.rename(tmp_path / "copy-away")
    queried = rlpipe("sql", str(second / "rl"), "select count(distinct step) as n from train_steps", env=env)
    assert queried.returncode == 0 and "4" in queried.stdout, queried.stderr[-2000:]
    replayed = rlpipe("replay", str(second / "rl"), "--step", "1", env=env)  # from the copy's SFT checkpoint
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert f"trainer state from {second / 'sft'}" in replayed.stdout


PROBE = """
from pathlib import Path
Path(__file__).with_name("imported.marker").write_text("imported")
"""


def test_what_each_command_imports_from_a_run_folder(tmp_path, prefect_api_url):
    env = env_for(tmp_path, prefect_api_url)
    runs = tmp_path / "runs"
    made = rlpipe("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=t",
                  "--set", "sft.steps=4", "--set", "rl.steps=2", *ONE_THREAD, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    run_dir = runs / "t"
    work = tmp_path / "work"  # user code is found in the working directory (core/user_code.py)
    work.mkdir()
    (work / "trustprobe.py").write_text(PROBE)
    marker = work / "imported.marker"
    for folder in (run_dir, run_dir / "sft", run_dir / "rl"):  # the run's config now names code
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["task"] = {**config["task"], "env": "dataset",
                          "options": {"path": str(tmp_path / "absent.jsonl"), "reward_module": "trustprobe"}}
        path.write_text(json.dumps(config))

    readers = [("sql", str(run_dir / "rl"), "select count(*) from rollouts"),
               ("report", str(run_dir / "rl"), "--out", str(tmp_path / "report.html")),
               ("replay", str(run_dir / "rl"), "--step", "2"),
               ("lineage", "models:/t/1", "--tracking-uri", env["MLFLOW_TRACKING_URI"])]
    for args in readers:
        done = rlpipe(*args, env=env, cwd=work)
        assert done.returncode == 0, (args, done.stdout[-1500:], done.stderr[-1500:])
        assert not marker.exists(), f"rlpipe {args[0]} imported the run folder's reward_module"

    rescored = rlpipe("rescore", str(run_dir / "rl"), "--reward", "rlpipe.envs.rewards:exact_match", env=env, cwd=work)
    assert "rlpipe rescore: imports trustprobe named by" in rescored.stderr, rescored.stderr[-2000:]
    assert marker.exists()
    marker.unlink()

    state = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**state, "status": "failed"}))  # a run left to resume
    resumed = rlpipe("resume", str(run_dir), env=env, cwd=work)
    assert "rlpipe resume: imports trustprobe named by" in resumed.stderr, resumed.stderr[-2000:]
