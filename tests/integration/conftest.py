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
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.ports import start_on_free_port
from tests.prefect_server import stop_group, wait_healthy


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory) -> Iterator[str]:
    """The API URL of a Prefect server on a free loopback port (started again on another where its
    port was taken before it bound), its database in a temporary dir; stopped (its whole process group) when the session ends."""
    home = tmp_path_factory.mktemp("prefect-server")
    log = home / "server.log"

    def start(port: int) -> subprocess.Popen:
        url = f"http://127.0.0.1:{port}/api"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_UI_ENABLED="false",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_LOGGING_LEVEL="WARNING")
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log.open("w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, server, log)
        except BaseException:
            stop_group(server)
            raise
        return server

    port, server = start_on_free_port(start)
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop_group(server)
