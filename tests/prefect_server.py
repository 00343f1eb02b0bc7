"""A server process for tests (Prefect, vLLM): wait until it answers, stop its whole process group;
one server shared by the session's workers (`shared_by_workers`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
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
    """SIGTERM the process group (started with start_new_session), SIGKILL what is left after 30 s;
    then reap the process."""
    stop_group_of(process.pid)
    process.wait(timeout=30)


@contextlib.contextmanager
def shared_by_workers(folder: Path, start: Callable[[], tuple[str, subprocess.Popen]]) -> Iterator[str]:
    """The URL of one server for all of the test session's workers that use it: the first to ask
    starts it (`start()` returns its URL and process) and each one using it is listed in `folder`;
    the last to leave stops its process group, and a worker that asks later starts it again. A
    worker that died without leaving is not counted (its pid is gone). All of it under one lock."""
    folder.mkdir(exist_ok=True)
    users, state = folder / "users", folder / "server.json"
    users.mkdir(exist_ok=True)
    me = users / str(os.getpid())
    with _locked(folder):
        known = json.loads(state.read_text()) if state.exists() else None
        if known is None or not _running(known["pid"]):
            url, server = start()
            known = {"url": url, "pid": server.pid}
            state.write_text(json.dumps(known))
        me.touch()
    try:
        yield known["url"]
    finally:
        with _locked(folder):
            me.unlink(missing_ok=True)
            if state.exists() and not any(_running(int(user.name)) for user in users.iterdir()):
                stop_group_of(json.loads(state.read_text())["pid"])  # the one running now
                state.unlink()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, ended but not yet reaped by its parent, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def stop_group_of(pid: int) -> None:
    """Stop the process group `pid` leads (it may be another process's child): SIGTERM, then SIGKILL
    what is left once the leader ends or 30 s pass."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
