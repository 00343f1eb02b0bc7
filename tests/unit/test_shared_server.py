"""tests/prefect_server.py `shared_by_workers`: the session's workers share one server. The first
to ask starts it, the others get its URL, it runs until the last of them leaves (however they
take turns), and whoever asks after that, or after it died, starts it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.prefect_server import _running

ROOT = Path(__file__).resolve().parents[2]

# a worker: enters shared_by_workers with a real HTTP server, says its URL, leaves once `hold` is gone
WORKER = """
import subprocess, sys, time
from pathlib import Path
from rlpipe.core.ports import free_port
from tests.prefect_server import shared_by_workers, wait_healthy

SERVER = (
    "import http.server, sys\\n"
    "class Ok(http.server.BaseHTTPRequestHandler):\\n"
    "    def do_GET(self):\\n"
    "        self.send_response(200); self.end_headers()\\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Ok).serve_forever()\\n")
folder, hold = Path(sys.argv[1]), Path(sys.argv[2])

def start():
    port = free_port()
    log = folder.parent / f"server-{port}.log"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}", server, log, start_s=60, name="test server")
    return f"http://127.0.0.1:{port}", server

with shared_by_workers(folder, start) as url:
    print(url, flush=True)
    while hold.exists():
        time.sleep(0.05)
"""


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def worker(folder: Path, hold: Path) -> tuple[subprocess.Popen, str]:
    hold.touch()
    process = subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(hold)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return process, process.stdout.readline().strip()


def leave(process: subprocess.Popen, hold: Path) -> None:
    hold.unlink()
    assert process.wait(timeout=60) == 0


@pytest.mark.parametrize("last", ["first", "second"])
def test_one_server_runs_until_the_last_worker_leaves_and_starts_again_after(tmp_path, last):
    folder = tmp_path / "shared"
    first, url = worker(folder, tmp_path / "hold-1")
    second, same = worker(folder, tmp_path / "hold-2")
    assert url.startswith("http://127.0.0.1:") and same == url and answers(url)
    pid = json.loads((folder / "server.json").read_text())["pid"]

    order = [(first, tmp_path / "hold-1"), (second, tmp_path / "hold-2")]
    if last == "first":
        order.reverse()
    leave(*order[0])
    assert answers(url)  # one worker still uses it
    leave(*order[1])
    deadline = time.monotonic() + 30
    while answers(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not answers(url) and not (folder / "server.json").exists()
    assert not _running(pid)  # gone, or ended and waiting for its parent to reap it

    # a worker that asks after that starts it again
    third, again = worker(folder, tmp_path / "hold-3")
    try:
        assert answers(again) and json.loads((folder / "server.json").read_text())["pid"] != pid
    finally:
        leave(third, tmp_path / "hold-3")
    assert not answers(again)


def test_a_server_that_died_is_started_again_and_the_last_to_leave_stops_that_one(tmp_path):
    folder = tmp_path / "shared"
    first, url = worker(folder, tmp_path / "hold-1")
    dead = json.loads((folder / "server.json").read_text())["pid"]
    os.killpg(dead, signal.SIGKILL)  # the server dies while a worker still uses it
    deadline = time.monotonic() + 30
    while answers(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    second, again = worker(folder, tmp_path / "hold-2")  # the next to ask starts another
    assert answers(again) and json.loads((folder / "server.json").read_text())["pid"] != dead
    leave(second, tmp_path / "hold-2")
    assert answers(again)  # the first worker still uses it
    leave(first, tmp_path / "hold-1")  # the last to leave stops the one running now, not the dead one
    assert not answers(again) and not (folder / "server.json").exists()
