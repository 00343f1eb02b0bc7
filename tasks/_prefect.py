"""How every stage becomes a Prefect task: named, never cached, results not persisted.

Stages take the model, optimizer or engine as arguments; Prefect must never hash or serialise
them, so caching and result persistence are off for all stages (tables are our persistence).
Stages that touch the network get retries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE


def stage(name: str, retries: int = 0, retry_delay_seconds: float = 1.0) -> Callable[[Callable], Any]:
    return task(
        name=name,
        cache_policy=NO_CACHE,
        persist_result=False,
        retries=retries,
        retry_delay_seconds=retry_delay_seconds,
        log_prints=False,
    )
