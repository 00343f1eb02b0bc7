"""Loopback ports for the servers tests start, without the pick-then-bind race.

A port picked free and released can be taken by another process before the server binds it.
Where the test itself binds (a socket it holds), nothing else can take it. Where a separate
process binds (a Prefect or vLLM server), `start_on_free_port` starts it and, when it exits
because its port was taken meanwhile, starts it again on a fresh port: a bounded number of
tries, every refused port and its reason in the failure.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

from rlpipe.core.ports import free_port

T = TypeVar("T")
PORT_TRIES = 3


class PortTaken(AssertionError):
    """A server exited because another process holds its port."""


def says_port_taken(log_text: str) -> bool:
    """Whether a server's output says it could not bind its address because it is in use."""
    text = log_text.lower()
    return "address already in use" in text or "eaddrinuse" in text or (
        "port" in text and "already in use" in text)


def start_on_free_port(start: Callable[[int], T], tries: int = PORT_TRIES) -> tuple[int, T]:
    """`start(port)` on a free loopback port; where it raises PortTaken, again on a fresh port
    (at most `tries` times). Returns the port and what `start` returned."""
    refused = []
    for _ in range(tries):
        port = free_port()
        try:
            return port, start(port)
        except PortTaken as exc:
            refused.append(f"port {port}: {str(exc)[-300:]}")
    raise AssertionError(f"no server started in {tries} tries, each port taken before it bound:\n"
                         + "\n".join(refused))


@contextlib.contextmanager
def closed_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A loopback port this test holds bound but not listening: connections to it are refused,
    and no other process can start listening on it while the block runs."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]
