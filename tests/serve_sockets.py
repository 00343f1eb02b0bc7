"""Helpers of the tests that talk to `rlpipe serve` over real sockets: an app on a loopback
port in a thread, an HTTP answer read whole, and the moment the server closes a connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serving(app: Any, **config: Any) -> Iterator[tuple[str, int]]:
    """`app` served by uvicorn on a free loopback port in a daemon thread (uvicorn.Config's
    `config` given on); yields the address, stops the server on leaving."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def read_answer(sock: socket.socket, limit_s: float) -> bytes:
    """One HTTP answer read whole (headers, then content-length bytes of body), or what came
    before the server closed the connection."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        head, blank, body = data.partition(b"\r\n\r\n")
        if blank and len(body) >= content_length(head):
            return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def closed_within(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closes `sock` (reads return b""), None if still open at limit_s."""
    sock.settimeout(limit_s)
    start = time.perf_counter()
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.perf_counter() - start
