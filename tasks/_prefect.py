"""How every stage becomes a Prefect task: named, never cached, results not persisted.

Stages take the model, optimizer, engine and whole tables as arguments. Prefect must never hash,
serialise or walk them: caching and result persistence are off, and every argument is passed
`quote`d, since Prefect otherwise visits each element of every list it is given (measured: 9 s per
call for 50,000 SFT sequences, 25 ms quoted). Stages that touch the network get retries.

A Prefect task run costs 3-10 ms of the step's critical path (run record, two state changes and
their events, on the same cores as training). Inside `stage_task_runs(False)` a stage is a plain
call (same retries, no task run): the flow run is still Prefect's, and every stage's seconds still
go to the `train_steps` table and MLflow. Worth it when steps are short (the demo's ~0.15 s).

A stage declares the tables it writes (`tables=`, tasks/record.py `StageTable`): the stage run
writes them, and on resume reads a stored result back instead of recomputing it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from rlpipe.core.termination import raise_if_terminated
from rlpipe.tasks.record import StageTable, run_with_tables

# per flow run (a ContextVar, so concurrent flows in one process do not see each other's choice)
_TASK_RUNS: ContextVar[bool] = ContextVar("rlpipe_stage_task_runs", default=True)


@contextmanager
def stage_task_runs(enabled: bool) -> Iterator[None]:
    """While the block runs, stages are Prefect task runs (True) or plain calls (False)."""
    token = _TASK_RUNS.set(enabled)
    try:
        yield
    finally:
        _TASK_RUNS.reset(token)


def call_with_retries(fn: Callable, retries: int, delay_s: float, /, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), tried again up to `retries` times after an exception (as Prefect would)."""
    for _ in range(retries):
        try:
            return fn(*args, **kwargs)
        except Exception:
            time.sleep(delay_s)
    return fn(*args, **kwargs)  # the last try: its exception propagates


def stage(name: str, retries: int = 0, retry_delay_seconds: float = 1.0, *,
          tables: tuple[StageTable, ...] = (), check: Callable[[Any], None] | None = None
          ) -> Callable[[Callable], Any]:
    """Decorate a stage function: calling it runs a Prefect task run named `name` (or, inside
    `stage_task_runs(False)`, the function itself with the same retries) that writes `tables`
    (read back instead of recomputed on resume; tasks/record.py `run_with_tables`), then runs
    `check(result)`, which may raise.

    The plain function, without tables, stays available as `.fn`.
    """

    def decorate(fn: Callable) -> Callable:
        def with_tables(*args: Any, **kwargs: Any) -> Any:
            return run_with_tables(fn, tables, check, *args, **kwargs)

        body = functools.wraps(fn)(with_tables) if tables or check is not None else fn

        prefect_task = task(
            body,
            name=name,
            cache_policy=NO_CACHE,
            persist_result=False,
            retries=retries,
            retry_delay_seconds=retry_delay_seconds,
            log_prints=False,
        )

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            raise_if_terminated()  # a SIGTERM whose exception was swallowed stops the run here
            if not _TASK_RUNS.get():
                return call_with_retries(body, retries, retry_delay_seconds, *args, **kwargs)
            return prefect_task(*(quote(a) for a in args), **{k: quote(v) for k, v in kwargs.items()})

        run.fn = fn
        run.task = prefect_task
        return run

    return decorate
