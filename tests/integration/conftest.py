"""Fixtures shared by the integration tests.

`prefect_api_url`: one `prefect server start` for the whole test session. Without PREFECT_API_URL
every `rlpipe run`/`rlpipe resume` subprocess starts its own embedded server (a uvicorn child and
a SQLite database migrated on first use): 10-30 s per process on 2 busy cores, and the kill/resume
tests start a dozen processes each. Tests that pass this URL to their subprocesses pay it once;
the rest (test_compile_run, the `straight` run of test_distributed_run) keep the embedded server
a user gets by default, so that path stays covered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from training.ports import free_port

SERVER_START_S = 180


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prefect server exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy within {SERVER_START_S}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory) -> Iterator[str]:
    """The API URL of a Prefect server on a free loopback port, its database in a temporary dir;
    stopped (its whole process group) when the session ends."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_UI_ENABLED="false",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_LOGGING_LEVEL="WARNING")
    log = home / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_healthy(url, server, log)
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(server.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        server.wait(timeout=30)
