"""The score stage's reward calls on a cluster, through Prefect's task runners: `DaskTaskRunner`
(prefect-dask, the `cluster` extra) or `RayTaskRunner` (prefect-ray, the `ray` extra).

`open_cluster([cluster])` gives None for `runner = "local"` (rewards stay in the flow's process,
nothing imported), else a `ClusterScoring`: rollouts/scoring.py hands it a round's rollouts cut
into batches of `batch_size` consecutive ones; each batch is one Prefect task run (`score-batch`)
on a worker, which pickles the environment with the batch and calls rollouts/scoring.py
`batch_rewards`, the same function the local path calls. Results come back per batch and are put
together in submission order, so the `scores` rows are the local run's, in the same order.

A worker that dies mid-batch: the Dask scheduler sends the batch to another worker (up to
`allowed_failures` times on a local cluster; a cluster at an address follows its scheduler's
setting); Ray runs it again (each batch is a Ray task of `max_retries = allowed_failures`, on a
local instance or at an address). Past that, or on any other failure of a batch, the step fails
with one line naming the batch and the cluster; the stage writes its table only after every batch came back, so nothing
of the round is stored, and a resumed step scores it again whole.

Workers need rlpipe installed (the same version) and reach the flow's Prefect API, where each
batch is recorded as a task run.
"""

from __future__ import annotations

import contextvars
import re
from contextlib import nullcontext
from typing import Any

import prefect.context
from prefect import task
from prefect.cache_policies import NO_CACHE
from rlpipe.envs.base import Environment, Example, RewardResult
from rlpipe.rollouts.records import Rollout
from rlpipe.rollouts.scoring import batch_rewards
from rlpipe.tasks.cluster_config import ClusterConfig, missing_extra


class ClusterError(RuntimeError):
    """A batch of reward calls that did not come back from the cluster."""


class ScoreBatch:
    """What one task run scores. A plain object, not a collection or dataclass: Prefect then does
    not walk every rollout of it (a `quote` would do that on the flow's side, but Dask turns the
    annotation, a tuple, into a plain tuple on the way)."""

    __slots__ = ("env", "examples", "rollouts")

    def __init__(self, env: Environment, examples: dict[str, Example], rollouts: list[Rollout]) -> None:
        self.env, self.examples, self.rollouts = env, examples, rollouts


def score_batch_fn(batch: ScoreBatch) -> list[RewardResult]:
    """One batch's rewards, on a worker."""
    return batch_rewards(batch.env, batch.examples, batch.rollouts)


score_batch = task(score_batch_fn, name="score-batch", cache_policy=NO_CACHE, persist_result=False, log_prints=False)
"""The task run of a batch; its function keeps its own module-level name, so workers import it
by name instead of receiving a pickled copy of it and the module globals it reads."""


def task_runner(cluster: ClusterConfig):
    """The Prefect task runner `[cluster]` names (not started)."""
    if cluster.runner == "ray":
        from prefect_ray import RayTaskRunner

        if cluster.address:
            return RayTaskRunner(address=cluster.address)
        return RayTaskRunner(init_kwargs={
            "num_cpus": cluster.workers, "include_dashboard": False,
            "resources": {name: amount * cluster.workers for name, amount in cluster.resources.items()} or None})
    from prefect_dask import DaskTaskRunner

    if cluster.address:
        return DaskTaskRunner(address=cluster.address)
    return DaskTaskRunner(cluster_kwargs={
        "n_workers": cluster.workers, "threads_per_worker": cluster.threads_per_worker, "processes": True,
        "dashboard_address": None, "resources": dict(cluster.resources) or None,
        "scheduler_kwargs": {"allowed_failures": cluster.allowed_failures}})


class ClusterScoring:
    """Batches of reward calls as task runs of a started Prefect task runner (rollouts/scoring.py
    `RemoteScoring`); `close` stops a cluster it started."""

    def __init__(self, runner: Any, cluster: ClusterConfig) -> None:
        self.runner = runner
        self.batch_size = cluster.batch_size
        self.resources = dict(cluster.resources)
        self.kind = cluster.runner
        self.retries = cluster.allowed_failures
        self.where = cluster.address or f"a local cluster of {cluster.workers} processes"

    def __call__(self, env: Environment, batches: list[tuple[dict[str, Example], list[Rollout]]],
                 ) -> list[list[RewardResult]]:
        futures = contextvars.Context().run(self._submit, [ScoreBatch(env, ex, rs) for ex, rs in batches],
                                            prefect.context.get_settings_context())
        try:
            return [self._result(future, index, len(batches), len(batches[index][1]))
                    for index, future in enumerate(futures)]
        finally:
            for future in futures:  # after a failure, the batches still queued are not run for nothing
                _cancel(future, self.kind)

    def _submit(self, batches: list[ScoreBatch], settings: Any) -> list[Any]:
        """Each batch a task run, submitted outside the flow's and the stage's run contexts (run in
        an empty contextvars context): Prefect ships the contexts it finds with each task, and a
        flow run's holds what cannot be pickled. The settings (the API the workers report to) go
        along."""
        with prefect.context.SettingsContext(profile=settings.profile, settings=settings.settings), \
                self._placement():
            return [self.runner.submit(score_batch, {"batch": batch}) for batch in batches]

    def _placement(self):
        """What each batch asks of the cluster: Dask's resource annotation; Ray's task options, its
        retries after a worker died and its resources."""
        if self.kind == "ray":
            from prefect_ray.context import remote_options

            return remote_options(max_retries=self.retries, **({"resources": self.resources} if self.resources else {}))
        if not self.resources:
            return nullcontext()
        import dask

        return dask.annotate(resources=self.resources)

    def _result(self, future: Any, index: int, total: int, size: int) -> list[RewardResult]:
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - one line naming the batch and the cluster
            reason = " ".join(ANSI.sub("", str(exc)).split()) or type(exc).__name__
            raise ClusterError(f"score batch {index + 1} of {total} ({size} rollouts) failed on the {self.kind} "
                               f"cluster ({self.where}): {type(exc).__name__}: {reason[:300]}; nothing of the "
                               f"round was written, resume scores it again") from None

    def close(self) -> None:
        self.runner.__exit__(None, None, None)


ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""The colour codes Ray puts in a remote error's text."""


def _cancel(future: Any, kind: str) -> None:
    wrapped = getattr(future, "wrapped_future", None)
    if kind == "ray":
        import ray

        if not ray.wait([wrapped], timeout=0, fetch_local=False)[0]:  # a Ray ObjectRef has no cancel of its own
            ray.cancel(wrapped)
        return
    cancel = getattr(wrapped, "cancel", None)
    if callable(cancel) and not wrapped.done():
        cancel()


def open_cluster(cluster: ClusterConfig) -> ClusterScoring | None:
    """The started runner `[cluster]` names, or None for `runner = "local"`."""
    if cluster.runner == "local":
        return None
    reason = missing_extra(cluster)
    if reason:
        raise ClusterError(reason)
    runner = task_runner(cluster)
    runner.__enter__()
    try:
        if cluster.runner == "dask":
            runner.client  # noqa: B018 - connect now: an unreachable scheduler fails the run before step 1
    except BaseException:
        runner.__exit__(None, None, None)
        raise
    return ClusterScoring(runner, cluster)
