"""SIGTERM that cannot be lost.

A signal handler's exception is raised wherever the main thread happens to be. When that is a
garbage-collection callback or a `__del__` (SQLAlchemy's, under MLflow), Python prints
"Exception ignored" and carries on: the run went on to finish with exit 0 after SIGTERM. So a
SIGTERM also sets a flag, and every stage checks it before it starts (`raise_if_terminated`):
a swallowed signal stops the run at the next stage at the latest. A signal that lands inside
another library's error handling can surface as that library's error (Prefect's "Task run is not
set", when it arrives while a task run starts): `sigterm_received` lets the CLI still call it a
SIGTERM stop.

Inside a flow Prefect installs its own SIGTERM handler; `sigterm_is_sticky` chains in front of
it (the flag, then Prefect's handler) so Prefect's cancellation path is unchanged.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_RECEIVED = threading.Event()


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    in user code (a reward function's) swallows it, while every `finally` still runs."""


def raise_if_terminated() -> None:
    """Raise Terminated if a SIGTERM arrived in this process (even one whose exception was lost)."""
    if _RECEIVED.is_set():
        raise Terminated("stopped by signal SIGTERM")


def sigterm_received() -> bool:
    """Whether a SIGTERM arrived during the current run, whatever exception it surfaced as."""
    return _RECEIVED.is_set()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated in the main thread (once: a second one is
    ignored so the clean-up — draining writes, closing the MLflow run — is not cut short)."""

    def handler(signum, _frame):
        _RECEIVED.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(f"stopped by signal {signal.Signals(signum).name}")

    _RECEIVED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_is_sticky() -> Iterator[None]:
    """Inside the block, a SIGTERM sets the flag before the handler in place (Prefect's) runs."""
    if not _in_main_thread():  # signal handlers can only be set from the main thread
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        _RECEIVED.set()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise Terminated(f"stopped by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
