"""A server process for tests (Prefect, vLLM): wait until it answers, stop its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.ports import PortTaken, says_port_taken

SERVER_START_S = 180


def wait_healthy(url: str, server: subprocess.Popen, log: Path, start_s: float = SERVER_START_S,
                 name: str = "prefect server") -> None:
    """Return once `url`/health answers 200; fail with the server's log if it exits or times out
    (PortTaken where the log says its port was in use, so the caller can start it on another)."""
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            text = log.read_text()
            if says_port_taken(text):
                raise PortTaken(f"{name} exited, its port taken:\n{text[-3000:]}")
            raise AssertionError(f"{name} exited:\n{text[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{name} not healthy within {start_s}s:\n{log.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group (started with start_new_session), SIGKILL what is left after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
