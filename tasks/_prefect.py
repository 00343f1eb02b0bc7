"""How every stage becomes a Prefect task: named, never cached, results not persisted.

Stages take the model, optimizer, engine and whole tables as arguments. Prefect must never hash,
serialise or walk them: caching and result persistence are off, and every argument is passed
`quote`d, since Prefect otherwise visits each element of every list it is given (measured: 9 s per
call for 50,000 SFT sequences, 25 ms quoted). Stages that touch the network get retries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote


def stage(name: str, retries: int = 0, retry_delay_seconds: float = 1.0) -> Callable[[Callable], Any]:
    """Decorate a stage function: calling it runs a Prefect task run named `name`.

    The plain function stays available as `.fn` (tests call it without the engine).
    """

    def decorate(fn: Callable) -> Callable:
        prefect_task = task(
            fn,
            name=name,
            cache_policy=NO_CACHE,
            persist_result=False,
            retries=retries,
            retry_delay_seconds=retry_delay_seconds,
            log_prints=False,
        )

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return prefect_task(*(quote(a) for a in args), **{k: quote(v) for k, v in kwargs.items()})

        run.fn = fn
        run.task = prefect_task
        return run

    return decorate
