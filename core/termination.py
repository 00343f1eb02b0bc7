"""SIGTERM and Ctrl-C (SIGINT) that cannot be lost.

A signal handler's exception is raised wherever the main thread happens to be. When that is a
garbage-collection callback or a `__del__` (SQLAlchemy's, under MLflow), Python prints
"Exception ignored" and carries on: the run went on to finish with exit 0 after SIGTERM. So a
stop signal also sets a flag, and every stage checks it before it starts (`raise_if_terminated`):
a swallowed signal stops the run at the next stage at the latest. A signal that lands inside
another library's error handling can surface as that library's error (Prefect's "Task run is not
set", when it arrives while a task run starts): `stop_signal` lets the CLI still call it a stop
by that signal.

SIGTERM raises `Terminated`; SIGINT raises KeyboardInterrupt, as Python's own handler does. Either
way a second signal is ignored while the run cleans up (queued writes drain, run.json and MLflow
say failed), which takes seconds.

Inside a flow Prefect installs its own SIGTERM handler; `sigterm_is_sticky` chains in front of
it (the flag, then Prefect's handler) so Prefect's cancellation path is unchanged.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_RECEIVED: dict[str, str] = {}  # "signal": the name of the stop signal received during this run
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    in user code (a reward function's) swallows it, while every `finally` still runs."""


def _stop_exception(name: str) -> BaseException:
    return KeyboardInterrupt() if name == "SIGINT" else Terminated(f"stopped by signal {name}")


def raise_if_terminated() -> None:
    """Raise the stop signal's exception (Terminated, or KeyboardInterrupt for Ctrl-C) if one
    arrived in this process, even one whose exception was lost."""
    if (name := stop_signal()) is not None:
        raise _stop_exception(name)


def stop_signal() -> str | None:
    """The name of the stop signal (SIGTERM, SIGINT) that arrived during the current run, whatever
    exception it surfaced as; None when none did."""
    return _RECEIVED.get("signal")


def sigterm_received() -> bool:
    """Whether a stop signal arrived during the current run."""
    return stop_signal() is not None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main
    thread (once: a second stop signal is ignored so the clean-up — draining writes, closing the
    MLflow run — is not cut short)."""

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        _RECEIVED.setdefault("signal", name)
        for other in _STOP_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise _stop_exception(name)

    _RECEIVED.clear()
    previous = {signum: signal.signal(signum, handler) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextmanager
def sigterm_is_sticky() -> Iterator[None]:
    """Inside the block, a stop signal sets the flag before the handler in place (Prefect's)
    runs."""
    if not _in_main_thread():  # signal handlers can only be set from the main thread
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        _RECEIVED.setdefault("signal", name)
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:
            raise _stop_exception(name)

    for signum in _STOP_SIGNALS:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
