"""The score stage's reward calls on a real cluster started here, through Prefect's task runners:
a Dask `distributed.LocalCluster` of 2 process workers (prefect-dask) and a local Ray instance of
2 CPUs (prefect-ray, where the `ray` extra is installed). On each, the same `scores` rows, in the
same order, as in-process scoring; a worker killed mid-batch has its batch run again; a batch that
keeps killing its workers fails the round in one line."""

from __future__ import annotations

import pytest
from prefect import flow, task
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.tasks.cluster import ClusterError, open_cluster
from rlpipe.tasks.cluster_config import ClusterConfig

from tests.killing_env import KillingEnv
from tests.rollout_rows import rollout

RUNNERS = {"dask": ("prefect_dask", "cluster", "KilledWorker"), "ray": ("prefect_ray", "ray", "WorkerCrashedError")}
"""Per runner: the module it needs, the extra that installs it, and the error of a batch whose
workers all died."""
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_in_process")]


@pytest.fixture(scope="module", params=list(RUNNERS))
def cluster(request):
    module, extra, _ = RUNNERS[request.param]
    pytest.importorskip(module, reason=f"cluster.runner = {request.param!r} needs the {extra!r} extra")
    scoring = open_cluster(ClusterConfig(runner=request.param, workers=2, batch_size=5, allowed_failures=1))
    yield scoring
    scoring.close()


def round_of(env, n=18):
    examples = {e.example_id: e for e in env.examples("train")[:n]}
    rollouts = [rollout(sample_id=f"s{i}", example_id=e.example_id, group_id=f"g{i // 3}",
                        completion_text=str(e.answer if i % 2 else "12"), completion_tokens=[0] * (i % 4))
                for i, e in enumerate(examples.values())]
    return examples, rollouts


def test_cluster_scores_equal_local_scores_in_order(cluster, tmp_path):
    env = KillingEnv(tmp_path / "killed", victim="none")
    examples, rollouts = round_of(env)
    penalty = lambda n: -0.1 * n  # noqa: E731 - applied where the rows are built, in the flow's process
    local = score_rollouts(env, examples, rollouts, ScoreOptions(0.0, penalty))
    stage = task(score_rollouts, name="score")  # as a flow's score stage sends its batches

    @flow
    def scoring():
        return stage(env, examples, rollouts, ScoreOptions(0.0, penalty, remote=cluster))

    remote = scoring()
    assert [r.row() for r in remote] == [r.row() for r in local]
    assert [r.sample_id for r in remote] == [r.sample_id for r in rollouts]
    assert len({r.reward for r in local}) > 1  # right and wrong answers both present


def test_killed_worker_batch_is_retried_elsewhere(cluster, tmp_path):
    env = KillingEnv(tmp_path / "killed", victim="")
    examples, rollouts = round_of(env)
    env.victim = rollouts[7].example_id  # the second of four batches
    local = score_rollouts(env, examples, rollouts, ScoreOptions())
    assert not env.marker.exists()
    remote = score_rollouts(env, examples, rollouts, ScoreOptions(remote=cluster))
    assert env.marker.exists()  # a worker died mid-batch
    assert [r.row() for r in remote] == [r.row() for r in local]  # nothing lost, nothing doubled


def test_batch_that_keeps_killing_workers_fails_in_one_line(cluster, tmp_path):
    env = KillingEnv(tmp_path / "killed", victim="", always=True)
    examples, rollouts = round_of(env, n=6)
    env.victim = rollouts[5].example_id
    with pytest.raises(ClusterError) as failed:
        score_rollouts(env, examples, rollouts, ScoreOptions(remote=cluster))
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"score batch 2 of 2 (1 rollouts) failed on the {cluster.kind} cluster")
    assert RUNNERS[cluster.kind][2] in message
