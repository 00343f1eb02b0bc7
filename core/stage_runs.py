"""How a stage function is called: as a plain call with its retries, or through the runner the
orchestrator above installs (Prefect task runs, tasks/_prefect.py).

A stage is called where its work lives (a sampling round in rollouts/, a train step in tasks/),
so the call site never imports the orchestrator: it calls `run_stage`, which hands the call to
the runner of the enclosing `stage_runner(...)` block, or calls the function itself outside one.
The runner is held in a ContextVar: each flow (thread, context) sees only its own, and a
producer thread started with `contextvars.copy_context()` sees its flow's.

    with stage_runner(prefect_runner):
        run_stage("generate", generate_round, (examples,), {"step": 3})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol


class StageRunner(Protocol):
    """Runs one stage call: `fn(*args, **kwargs)` under `name`, tried again up to `retries`
    times `retry_delay_s` apart after an exception."""

    def __call__(self, name: str, fn: Callable, retries: int, retry_delay_s: float,
                 args: tuple, kwargs: dict) -> Any: ...


def call_with_retries(fn: Callable, retries: int, delay_s: float, /, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), tried again up to `retries` times after an exception (as Prefect would)."""
    for _ in range(retries):
        try:
            return fn(*args, **kwargs)
        except Exception:
            time.sleep(delay_s)
    return fn(*args, **kwargs)  # the last try: its exception propagates


def plain_runner(name: str, fn: Callable, retries: int, retry_delay_s: float, args: tuple, kwargs: dict) -> Any:
    """The stage as a plain call with its retries (no task run)."""
    return call_with_retries(fn, retries, retry_delay_s, *args, **kwargs)


_RUNNER: ContextVar[StageRunner] = ContextVar("rlpipe_stage_runner", default=plain_runner)


@contextmanager
def stage_runner(runner: StageRunner) -> Iterator[None]:
    """While the block runs, every stage call goes through `runner`."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def current_runner() -> StageRunner:
    """The runner a stage call made now goes through."""
    return _RUNNER.get()


def run_stage(name: str, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, retries: int = 0,
              retry_delay_s: float = 1.0) -> Any:
    """Call a stage, `fn(*args, **kwargs)`, through the current runner (the stage's own arguments
    are passed apart, so one may be named `retries`)."""
    return _RUNNER.get()(name, fn, retries, retry_delay_s, args, kwargs or {})
