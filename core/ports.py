"""A free loopback TCP port, for the process groups (MASTER_PORT) and local servers that tests
and benchmarks start on this machine. Standard library only, so importing it costs nothing.

The port is free when this returns and is released at once, so another process could take it
before the caller binds it: the tests start their servers through tests/ports.py, which starts
one again on a fresh port when that happens. Where the caller itself binds, pass port 0 and read the bound port back instead (`rlpipe serve
--port 0` does).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
