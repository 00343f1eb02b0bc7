"""Batches of a round's reward calls (rollouts/scoring.py `round_rewards`), the `[cluster]`
section and its refusals, without a cluster (tests/integration/test_cluster_scoring.py runs one)."""

from __future__ import annotations

import pytest
from rlpipe.core.config import ConfigError
from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.rollouts.scoring import ScoreOptions, batch_rewards, score_rollouts
from rlpipe.tasks.cluster import ClusterError, open_cluster
from rlpipe.tasks.cluster_config import ClusterConfig, missing_extra
from rlpipe.tasks.config import validate_config

from tests.rollout_rows import rollout


class InlineRemote:
    """Scores each batch here, answering the batches in reverse order of work but in their own
    order, and records the batches it was given."""

    def __init__(self, batch_size: int, drop: bool = False) -> None:
        self.batch_size, self.drop, self.sizes = batch_size, drop, []

    def __call__(self, env, batches):
        self.sizes = [len(rollouts) for _, rollouts in batches]
        parts = {i: batch_rewards(env, ex, rs) for i, (ex, rs) in reversed(list(enumerate(batches)))}
        if self.drop:
            parts[1] = parts[1][:-1]
        return [parts[i] for i in range(len(batches))]


def round_of(n: int = 7):
    env = ArithmeticEnv()
    examples = {e.example_id: e for e in env.examples("train")[:n]}
    rollouts = [rollout(sample_id=f"s{i}", example_id=e.example_id, completion_text=str(e.answer if i % 2 else 0))
                for i, e in enumerate(examples.values())]
    return env, examples, rollouts


def test_remote_batches_give_the_local_rows_in_order():
    env, examples, rollouts = round_of()
    remote = InlineRemote(batch_size=3)
    local = score_rollouts(env, examples, rollouts, ScoreOptions())
    rows = score_rollouts(env, examples, rollouts, ScoreOptions(remote=remote))
    assert remote.sizes == [3, 3, 1]  # batches of consecutive rollouts, not one call per completion
    assert [r.row() for r in rows] == [r.row() for r in local]
    assert {r.reward for r in rows} == {0.0, 1.0}


def test_a_batch_short_of_results_fails_naming_it():
    env, examples, rollouts = round_of()
    with pytest.raises(RuntimeError, match="score batch 2 of 3 came back with 2 results for 3 rollouts"):
        score_rollouts(env, examples, rollouts, ScoreOptions(remote=InlineRemote(3, drop=True)))


def test_cluster_section_defaults_to_local_and_opens_nothing():
    config = validate_config({})
    assert config.cluster.runner == "local"
    assert open_cluster(config.cluster) is None


def test_cluster_section_refuses_unknown_runner_and_bad_batch_size():
    with pytest.raises(ConfigError, match="cluster.runner"):
        validate_config({"cluster": {"runner": "spark"}})
    with pytest.raises(ConfigError, match="cluster.batch_size"):
        validate_config({"cluster": {"batch_size": 0}})


def test_runner_without_its_extra_is_refused_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prefect_ray" else real(name, *a))
    cluster = ClusterConfig(runner="ray")
    line = missing_extra(cluster)
    assert line == ("cluster.runner: 'ray' needs prefect-ray, which is not installed (pip install -e '.[ray]' on the "
                    "flow's machine and every worker, or cluster.runner = 'local')")
    with pytest.raises(ClusterError, match=r"\.\[ray\]"):
        open_cluster(cluster)


def test_preflight_refuses_a_runner_without_its_extra(monkeypatch):
    import importlib.util

    from rlpipe.tasks.preflight import _check_placement

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prefect_dask" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^cluster.runner: 'dask' needs prefect-dask, .*\.\[cluster\]"):
        _check_placement(validate_config({"cluster": {"runner": "dask"}}))


def test_ray_starts_an_instance_of_the_workers_cpus_or_joins_the_address_and_retries_each_batch():
    pytest.importorskip("prefect_ray", reason="cluster.runner = 'ray' needs the 'ray' extra")
    from prefect_ray.context import RemoteOptionsContext
    from rlpipe.tasks.cluster import ClusterScoring, task_runner

    local = ClusterConfig(runner="ray", workers=3, resources={"sandbox": 1}, allowed_failures=4)
    runner = task_runner(local)
    assert runner.address is None
    assert runner.init_kwargs == {"num_cpus": 3, "include_dashboard": False, "resources": {"sandbox": 3},
                                  "namespace": "prefect"}
    assert task_runner(ClusterConfig(runner="ray", address="ray://head:10001")).address == "ray://head:10001"
    with ClusterScoring(runner, local)._placement():
        assert RemoteOptionsContext.get().current_remote_options == {"max_retries": 4, "resources": {"sandbox": 1}}
