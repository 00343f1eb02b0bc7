"""`[cluster]`: where the score stage's reward calls run (tasks/cluster.py).

Kept apart from tasks/cluster.py so that reading a config imports neither Prefect's task runners
nor Dask.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from rlpipe.core.config import Section

EXTRAS = {"dask": ("prefect_dask", "cluster"), "ray": ("prefect_ray", "ray")}
"""Per runner: the module it needs and the extra that installs it."""


class ClusterConfig(Section):
    """`[cluster]`: the score stage's reward calls in the flow's process (local), or in batches on
    a Dask or Ray cluster through Prefect's task runners (docs/CLUSTER.md)."""

    runner: Literal["local", "dask", "ray"] = "local"
    """local: rewards run in the flow's process (the default) | dask: on a Dask cluster
    (prefect-dask, the `cluster` extra) | ray: on a Ray cluster (prefect-ray, the `ray` extra)."""
    address: str = ""
    """The cluster's scheduler (dask: tcp://HOST:8786; ray: ray://HOST:10001). Empty: the flow
    starts a cluster of `workers` local processes and stops it at the run's end."""
    workers: int = Field(2, ge=1)
    """Worker processes of the local cluster started when `address` is empty (Ray: the local
    instance's CPUs, one batch at a time on each)."""
    threads_per_worker: int = Field(1, ge=1)
    """Threads of each local Dask worker process (the code environment's sandboxes run in parallel
    inside a batch already, task.options.workers). Ray runs one batch per worker process."""
    batch_size: int = Field(32, ge=1)
    """Completions per batch sent to a worker: one task run per batch, so its fixed cost (a
    Prefect task run, the pickled batch and environment, a round trip) is shared by the batch."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Worker resources each batch needs (Dask's abstract resources, Ray's custom resources, e.g.
    {sandbox = 1}): only workers (Ray: nodes) that declare them take batches. A local cluster's
    workers declare them (a local Ray instance: `workers` times each)."""
    allowed_failures: int = Field(2, ge=0)
    """How often a batch whose worker died is run again before the step fails: on a local Dask
    cluster (a Dask cluster at `address` follows its scheduler's own setting,
    distributed.scheduler.allowed-failures), and on Ray, local or at `address` (each batch's
    max_retries)."""


def missing_extra(cluster: ClusterConfig) -> str | None:
    """One line saying what to install when `cluster.runner` needs a package that is absent, else None."""
    from importlib.util import find_spec

    if cluster.runner not in EXTRAS:
        return None
    module, extra = EXTRAS[cluster.runner]
    if find_spec(module) is None:
        return (f"cluster.runner: {cluster.runner!r} needs {module.replace('_', '-')}, which is not installed "
                f"(pip install -e '.[{extra}]' on the flow's machine and every worker, or cluster.runner = 'local')")
    return None
