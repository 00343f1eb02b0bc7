"""`rlpipe serve` in a child process, for the tests, benchmarks and scripts that drive HttpEngines
against local servers: start it on a free loopback port (--port 0), read its URL from the first
stdout line (engines/serve_cli.py prints "... listening on URL ..."), stop it.

    proc = start_serve(checkpoint, "--allow-root", str(root), threads=1, token="secret")
    url = serve_url(proc)                 # http://127.0.0.1:PORT; the process is killed if not
    ...
    stop_processes([proc])

Several servers start faster when every `start_serve` comes before the first `serve_url`.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0


def start_serve(checkpoint: str | os.PathLike, *args: str, threads: int = 1, token: str | None = None,
                popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> subprocess.Popen:
    """`rlpipe serve MODEL --host 127.0.0.1 --port 0 --threads N ARGS...`, stdout piped.

    token: the API token the server requires (RLPIPE_API_TOKEN); None: none, even when this
    process has RLPIPE_API_TOKEN set.
    popen: what starts the process, with subprocess.Popen's arguments (the tests fork theirs from
    an interpreter that has imported the CLI's modules already).
    """
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_API_TOKEN"}
    env.update(OMP_NUM_THREADS=str(max(threads, 1)), TOKENIZERS_PARALLELISM="false")
    if token is not None:
        env["RLPIPE_API_TOKEN"] = token
    return popen(
        [sys.executable, "-m", "rlpipe.flows.cli", "serve", str(checkpoint), "--host", "127.0.0.1",
         "--port", "0", "--threads", str(threads), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )


def serve_url(proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> str:
    """The base URL a started server listens on; RuntimeError (the process killed) when it does
    not say so within `timeout_s`."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        proc.kill()
        raise RuntimeError(f"rlpipe serve did not start within {timeout_s:g} s") from None
    if "listening on " not in line:
        proc.kill()
        raise RuntimeError(f"rlpipe serve did not start: {line!r}")
    return line.split("listening on ", 1)[1].split()[0]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Kill each process still running and reap it (bounded), closing its stdout."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
