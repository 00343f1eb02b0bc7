"""Stages as Prefect task runs: named, never cached, results not persisted.

Stages (storage/stage_tables.py `stage`) call through core/stage_runs.py; inside
`stage_task_runs(True)` (a flow's default, tracking.prefect_task_runs) each call is a Prefect
task run, so the flow run shows generate, score, filter, pack, train, ... in order, even for the
stages that live below tasks/ (a sampling round's, in rollouts/).

Stages take the model, optimizer, engine and whole tables as arguments. Prefect must never hash,
serialise or walk them: caching and result persistence are off, and every argument is passed
`quote`d, since Prefect otherwise visits each element of every list it is given (measured: 9 s per
call for 50,000 SFT sequences, 25 ms quoted). Stages that touch the network get retries.

A Prefect task run costs 3-10 ms of the step's critical path (run record, two state changes and
their events, on the same cores as training). Inside `stage_task_runs(False)` a stage is a plain
call (same retries, no task run): the flow run is still Prefect's, and every stage's seconds still
go to the `train_steps` table and MLflow. Worth it when steps are short (the demo's ~0.15 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from rlpipe.core.stage_runs import plain_runner, stage_runner


@functools.cache
def prefect_task(name: str, fn: Callable, retries: int, retry_delay_s: float):
    """The one Prefect task of a stage function (made on its first call)."""
    return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False, retries=retries,
                retry_delay_seconds=retry_delay_s, log_prints=False)


def prefect_runner(name: str, fn: Callable, retries: int, retry_delay_s: float, args: tuple, kwargs: dict) -> Any:
    """A stage call as a Prefect task run, every argument quoted."""
    return prefect_task(name, fn, retries, retry_delay_s)(*(quote(a) for a in args),
                                                          **{k: quote(v) for k, v in kwargs.items()})


@contextmanager
def stage_task_runs(enabled: bool) -> Iterator[None]:
    """While the block runs, stages are Prefect task runs (True) or plain calls (False)."""
    with stage_runner(prefect_runner if enabled else plain_runner):
        yield
