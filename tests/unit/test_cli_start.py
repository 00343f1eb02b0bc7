"""What a user meets first: a config error, and `--help-config`, come back in a fraction of a
second, before torch, transformers, Prefect or MLflow is imported (the config sections validate
against training/loss_choice.py, which needs none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HEAVY = ("torch", "transformers", "prefect", "mlflow")
PROBE = """
import json, sys
from rlpipe.flows.cli import main
code = main(sys.argv[1:])
print(json.dumps({"heavy": sorted(m for m in HEAVY if m in sys.modules)}))
sys.exit(code)
""".replace("HEAVY", repr(HEAVY))


def cli_in_fresh_process(*args: str) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - start


@pytest.mark.parametrize("args, code", [
    (["run", "{config}"], 2),
    (["run", "{config}", "--set", "rl.stepz=3"], 2),
    (["run", "--help-config"], 0),
])
def test_config_errors_and_help_come_before_any_heavy_import(tmp_path, args, code):
    config = tmp_path / "typo.toml"
    config.write_text('flow = "rl"\n[rl]\nsteps = 3\n' + ('' if "--set" in args else 'stepz = 3\n'))
    returncode, out, err, seconds = cli_in_fresh_process(*(a.format(config=config) for a in args))
    assert returncode == code, err
    assert json.loads(out.strip().splitlines()[-1]) == {"heavy": []}
    if code == 2:
        assert err.strip().endswith("rl.stepz: unknown key; did you mean rl.steps?"), err
        assert ("(--set rl.stepz=3)" in err) == ("--set" in args), err  # said against what made it
        assert len(err.strip().splitlines()) == 1, err
    assert seconds < 10, seconds  # about 1 s; the bound leaves room for a loaded machine


def test_a_run_says_what_it_is_doing_at_once(tmp_path):
    # the first line comes after validation, before pre-flight imports torch (seconds) and
    # long before the Prefect API and the model are up; the process is stopped there
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "rlpipe.flows.cli", "run", str(config), "--set",
                                f"runs_root={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, cwd=tmp_path)
    try:
        first = process.stdout.readline()
        seconds = time.perf_counter() - start
    finally:
        process.kill()
        process.wait(timeout=30)
    assert first.startswith(f"rlpipe: pipeline run → {tmp_path / 'tiny'}: checking the model"), first
    assert seconds < 10, seconds  # about 1 s; the bound leaves room for a loaded machine


EMBEDDED = """
import json, subprocess, sys
from rlpipe.flows.prefect_api import embedded_server_in_own_session
embedded_server_in_own_session()
module = sys.modules.get("prefect.server.api.server")
print(json.dumps({"loaded": module is not None,
                  "own_session": module is not None and module.subprocess is not subprocess}))
"""


@pytest.mark.parametrize("api_url", ["", "http://127.0.0.1:9/api"])
def test_the_embedded_server_is_prepared_only_where_no_api_url_is_set(tmp_path, api_url):
    """Without PREFECT_API_URL the run's embedded server will start in a session of its own;
    with one set no embedded server starts, so Prefect's server package is never imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path), **({"PREFECT_API_URL": api_url} if api_url else {}))
    done = subprocess.run([sys.executable, "-c", EMBEDDED], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == ({"loaded": False, "own_session": False} if api_url else {"loaded": True, "own_session": True})


EXIT_PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))  # runs after
from rlpipe.core.environment import exit_without_final_collections
from rlpipe.flows.cli import main
code = main(sys.argv[1:])
atexit.register(lambda: print("frozen before a later handler:", gc.get_freeze_count() > 0, flush=True))
before = atexit._ncallbacks()
exit_without_final_collections()  # a second call
print("handlers added again:", atexit._ncallbacks() - before, flush=True)
sys.exit(code)
"""


def test_a_command_exits_without_the_interpreters_final_collections(tmp_path):
    """Every `rlpipe` command freezes the garbage collector's objects as its last exit handler
    (core/environment.py): the handlers registered after it (Prefect's, MLflow's) run first and
    unfrozen, and the interpreter's shutdown then skips collecting what is left."""
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, "sql", "--list"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-3:] == ["handlers added again: 0", "frozen before a later handler: False", "frozen at exit: True"], lines
