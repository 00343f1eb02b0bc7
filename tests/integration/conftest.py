"""Fixtures shared by the integration tests.

`prefect_api_url`: one `prefect server start` for the whole test session, shared by its workers.
Without PREFECT_API_URL every `rlpipe run`/`rlpipe resume` subprocess starts its own embedded
server (a uvicorn child and a SQLite database migrated on first use): 10-30 s per process on 2
busy cores, and the kill/resume tests start a dozen processes each. Tests that pass this URL to
their subprocesses pay it once; the rest (test_compile_run, the `straight` run of
test_distributed_run, the Ctrl-C test of test_faults) keep the embedded server a user gets by
default, so that path stays covered.

`prefect_in_process`: in-process flows (pipeline_flow(...), rl_flow(...)) run against that same
server, a module at a time, rather than under a `prefect_test_harness` each, which starts a server
of its own (its SQLite migrated) for every module or test: 10-20 s on 2 busy cores.

`straight_tiny_run`: one uninterrupted `rlpipe run configs/tiny.toml` per test session (both xdist
workers share it, tests/built_once.py), which tests compare against or copy, never change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import warm_cli
from tests.built_once import build_once, session_folder
from tests.ports import start_on_free_port
from tests.prefect_server import shared_by_workers, stop_group, wait_healthy

# The server's background services that no test needs: the ones for schedules, late or paused
# runs, automations, work-pool health and housekeeping, and the one that stores events (a tiny
# run's task runs send hundreds). They cost a fifth of the server's CPU per run (4.1 s instead of
# 5.2 s); the task run recorder, which the tests that read task runs need, stays on.
IDLE_SERVICES = ("CANCELLATION_CLEANUP", "DB_VACUUM", "EVENT_PERSISTER", "EVENT_LOGGER", "FOREMAN", "LATE_RUNS",
                 "SCHEDULER", "PAUSE_EXPIRATIONS", "REPOSSESSOR", "CLEANUP_RECONCILER", "TRIGGERS")


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory) -> Iterator[str]:
    """The API URL of the session's Prefect server, one for all of its workers (each of its own
    cost some 10 CPU seconds to start and 1 a minute to keep), on a free loopback port (started
    again on another where its port was taken before it bound), its database in the session's
    temporary folder; stopped (its whole process group) when the last worker using it is done."""
    home = session_folder(tmp_path_factory) / "prefect-server"
    log = home / "server.log"

    def start_on(port: int) -> subprocess.Popen:
        url = f"http://127.0.0.1:{port}/api"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_UI_ENABLED="false",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_LOGGING_LEVEL="WARNING")
        env.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in IDLE_SERVICES})
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log.open("a"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, server, log)
        except BaseException:
            stop_group(server)
            raise
        return server

    def start() -> tuple[str, subprocess.Popen]:
        port, server = start_on_free_port(start_on)
        return f"http://127.0.0.1:{port}/api", server

    with shared_by_workers(home, start) as url:
        yield url


@pytest.fixture(scope="module")
def prefect_in_process(prefect_api_url) -> Iterator[None]:
    """While the module's tests run, this process's flows talk to the session's Prefect server (as
    prefect_test_harness sets its own server's URL); at the end, the logs and events they queued
    are sent before the URL goes back."""
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api_url}), \
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
        # the second, as prefect_test_harness does: threads that start without a settings context
        # of their own (a run's producer and writer threads) see the same server
        yield
        try:
            APILogWorker.instance().drain()
        except RuntimeError:  # never started
            pass
        EventsWorker.drain_all()


@pytest.fixture(scope="session")
def straight_tiny_run(tmp_path_factory, prefect_api_url) -> Path:
    """A folder holding `runs/straight`, an uninterrupted `rlpipe run configs/tiny.toml` with
    test_faults.OVERRIDES (progress made durable often, one torch thread), and `mlflow.db`, its
    MLflow store: what the kill-and-resume tests must end with (weights, row counts, the `best`
    aliases), and a finished run for tests that copy one. Run once per session, then only read."""
    from test_faults import STEP_TIMEOUT_S, run_args  # same folder: pytest puts it on sys.path
    from test_resume import cli, env_for

    def build(folder: Path) -> None:
        log = folder / "straight.log"  # a file, not a pipe nobody reads while the run writes to it
        with log.open("w") as stderr:
            done = warm_cli.run(cli(*run_args(folder / "runs", "straight")), env=env_for(folder, prefect_api_url),
                                cwd=folder, stdout=subprocess.DEVNULL, stderr=stderr, timeout=STEP_TIMEOUT_S)
        assert done.returncode == 0, log.read_text()[-3000:]

    return build_once(tmp_path_factory, "straight-tiny-run", build)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory) -> Path:
    """`runs/straight` of an uninterrupted `rlpipe run configs/tiny.toml --nproc-per-node 2`
    (test_distributed_run.command): what the 2-rank and the two-node tests compare with. Run once
    per session, then only read."""
    from test_distributed_run import TIMEOUT_S, command
    from test_resume import env_for

    def build(folder: Path) -> None:
        done = warm_cli.run(command(folder / "runs", "straight"), env=env_for(folder), cwd=folder,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "training with ddp" in done.stderr  # train.parallel 'none' + --nproc-per-node

    return build_once(tmp_path_factory, "two-rank-run", build) / "runs" / "straight"

