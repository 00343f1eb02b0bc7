"""tests/warm_cli.py: a CLI command or a `python -c` script forked from the warm zygote behaves as
the process a cold `python -m rlpipe.flows.cli` or `python -c` would be: its own pid and session,
the environment, working folder, arguments and streams it was given, a sitecustomize put before
PYTHONPATH run first, its exit status and the signal that killed it; anything else runs cold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_cli

pytestmark = pytest.mark.slow

HOOK = """\
import json, os, sys, time
with open(os.environ["WARM_MARK"], "w") as f:
    json.dump({"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "path0": sys.path[0],
               "torch_loaded": "torch" in sys.modules, "marker": os.environ.get("RLPIPE_WARM_MARKER")}, f)
if os.environ.get("RLPIPE_WARM_SLEEP"):
    time.sleep(120)
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlpipe.flows.cli", *args]


def test_a_warm_child_is_a_process_of_its_own_with_what_it_was_given(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_TEST_COLD_CLI", raising=False)
    hooks, work = tmp_path / "hooks", tmp_path / "work"
    hooks.mkdir(), work.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    mark = tmp_path / "mark.json"
    base = dict(os.environ)
    env = {**base, "WARM_MARK": str(mark), "RLPIPE_WARM_MARKER": "given",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), base.get("PYTHONPATH")]))}
    # WARM_MARK is not a variable the zygote may ignore: with it, the command runs cold, and says why
    with pytest.warns(warm_cli.ColdCommand, match=r"`--help \.\.\.` runs cold: WARM_MARK differ"):
        assert warm_cli.warm_args(cli("--help"), env) is None
    env.pop("WARM_MARK")
    env["RLPIPE_WARM_MARK"] = str(mark)  # RLPIPE_* may differ: read when used
    (hooks / "sitecustomize.py").write_text(HOOK.replace('"WARM_MARK"', '"RLPIPE_WARM_MARK"'))
    assert warm_cli.warm_args(cli("--help"), env) == ["--help"]

    # a config file that is not there: one line on stderr, exit 2
    done = warm_cli.run(cli("run", "missing.toml"), env=env, cwd=work, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "missing.toml" in done.stderr
    seen = json.loads(mark.read_text())
    assert seen["pid"] != os.getpid() and seen["cwd"] == str(work) and seen["path0"] == str(work)
    assert seen["marker"] == "given" and seen["torch_loaded"]  # warm: torch came from the zygote

    # killed in its own session, as the fault tests kill a run
    mark.unlink()
    process = warm_cli.Popen(cli("run", "missing.toml"), env={**env, "RLPIPE_WARM_SLEEP": "1"}, cwd=work,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = json.loads(mark.read_text())
    assert seen["pid"] == process.pid and seen["sid"] == process.pid and process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        warm_cli.run(cli("run", "missing.toml"), env={**env, "RLPIPE_WARM_SLEEP": "1"}, cwd=work, timeout=2)


PYTHON_C = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "pid": os.getpid(), "torch_loaded": "torch" in sys.modules}))
sys.exit(int(sys.argv[2]))
"""


def test_python_c_runs_warm_as_python_c_would(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_TEST_COLD_CLI", raising=False)
    command = [sys.executable, "-c", PYTHON_C, "a", "3"]
    assert warm_cli.warm_args(command, None) == ["-c", PYTHON_C, "a", "3"]
    done = warm_cli.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seen = json.loads(done.stdout)
    assert done.returncode == 3, done.stderr
    assert seen["argv"] == ["-c", "a", "3"] and seen["path0"] == "" and seen["cwd"] == str(tmp_path)
    assert seen["name"] == "__main__" and seen["pid"] != os.getpid() and seen["torch_loaded"]  # warm
    failed = warm_cli.run([sys.executable, "-c", "raise ValueError('boom')"], capture_output=True, text=True,
                          timeout=120)
    assert failed.returncode == 1 and failed.stderr.strip().splitlines()[-1] == "ValueError: boom"


def test_a_changed_import_time_variable_gets_a_zygote_of_its_own_and_the_first_is_kept(monkeypatch):
    monkeypatch.delenv("RLPIPE_TEST_COLD_CLI", raising=False)
    first = warm_cli.zygote()
    with monkeypatch.context() as changed:
        changed.setenv("HF_HOME", "/elsewhere")  # read at import by huggingface_hub
        other = warm_cli.zygote()
        assert other is not first and other.env["HF_HOME"] == "/elsewhere"
    assert warm_cli.zygote() is first and first.process.poll() is None
    # closed, a zygote leaves on its own at once (exit 0), not killed when its wait runs out
    other.close()
    assert other.process.returncode == 0


FORKED_ZYGOTE = """from tests import warm_cli
ranks = warm_cli.ForkedZygote()
ranks.close()
print(ranks.returncode)
"""


def test_a_rank_zygote_leaves_on_its_own_when_its_launcher_hangs_up(monkeypatch):
    """A warm launcher closes its rank zygote as it exits: the zygote must see its channel close
    and leave (exit 0), not be killed after the launcher waited for it."""
    monkeypatch.delenv("RLPIPE_TEST_COLD_CLI", raising=False)
    command = [sys.executable, "-c", FORKED_ZYGOTE]
    assert warm_cli.warm_args(command, None) is not None  # forked from the zygote: no thread runs yet
    done = warm_cli.run(command, cwd=Path(warm_cli.__file__).parents[1], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]


def test_other_commands_and_a_cold_request_run_as_plain_subprocesses(monkeypatch):
    assert warm_cli.warm_args([sys.executable, "-m", "json.tool", "--help"], None) is None
    assert warm_cli.warm_args([sys.executable, "-c"], None) is None  # no code: python's own error
    assert warm_cli.warm_args(cli("run", b"a\xffb"), None) is None  # bytes: only exec passes them as they are
    with pytest.warns(warm_cli.ColdCommand, match="HF_HOME differ"):
        assert warm_cli.warm_args(cli("--help"), {**os.environ, "HF_HOME": "/elsewhere"}) is None
    with pytest.raises(warm_cli.ColdCommand, match="HF_HOME"):  # in the suite, such a command fails its test
        warm_cli.run(cli("--help"), env={**os.environ, "HF_HOME": "/elsewhere"})
    monkeypatch.setenv("RLPIPE_TEST_COLD_CLI", "1")
    assert warm_cli.warm_args(cli("--help"), None) is None
    done = warm_cli.run([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 3


PRELOADED = """\
import importlib, json, logging, os, signal, sys, threading
from tests import warm_cli
handlers = {int(s): signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)}
for name in (*warm_cli.PRELOAD, *warm_cli.RUN_MODULES):
    importlib.import_module(name)
quiet = dict(threads=threading.active_count(),
             handlers_kept={int(s): signal.getsignal(s) for s in handlers} == handlers)
from prefect.settings import get_current_settings
os.environ.update(PREFECT_API_URL="http://127.0.0.1:9/the-child", PREFECT_LOGGING_LEVEL="ERROR")
warm_cli.refresh_prefect()
print(json.dumps({**quiet, "api_url": get_current_settings().api.url,
                  "flow_runs_level": logging.getLogger("prefect.flow_runs").getEffectiveLevel()}))
"""


def test_the_zygote_imports_start_nothing_and_prefect_takes_the_childs_settings():
    """What the zygote imports starts no thread and sets no signal handler (a forked child would
    inherit either), and a child's Prefect settings and log level are the ones of its own
    environment, not the zygote's."""
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/the-zygote", "PREFECT_LOGGING_LEVEL": "DEBUG"}
    done = subprocess.run([sys.executable, "-c", PRELOADED], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"threads": 1, "handlers_kept": True, "api_url": "http://127.0.0.1:9/the-child",
                    "flow_runs_level": 40}, seen
