"""Async RL (rl.off_policy.max_steps = k >= 1): the staleness bound, checked by SQL over the run's
tables, and every sampled completion's fate recorded once."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def query(run_dir: Path, sql: str) -> list[tuple]:
    con = duckdb.connect()
    for table in ("rollouts", "advantages", "groups", "train_steps", "checkpoints"):
        files = sorted((run_dir / "tables" / table).glob("step=*/*.parquet"))
        con.execute(f"create view {table} as select * from read_parquet({[str(f) for f in files]!r}, "
                    "union_by_name=true)")
    return con.execute(sql).fetchall()


def staleness_report(run_dir: Path) -> tuple:
    """(min lag, max lag, trained samples, distinct trained samples) over every trained sample."""
    return query(run_dir, """
        select min(a.step - 1 - r.policy_version), max(a.step - 1 - r.policy_version),
               count(*), count(distinct a.sample_id)
        from advantages a join rollouts r using (sample_id)""")[0]


def untracked_groups(run_dir: Path) -> int:
    """Sampled groups with no row in `groups` (every group must have a recorded fate)."""
    return query(run_dir, """
        select count(*) from (select distinct group_id from rollouts)
        where group_id not in (select group_id from groups)""")[0][0]


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_bound_holds_on_every_trained_sample(k, sft_checkpoint, tmp_path, monkeypatch):  # noqa: F811
    import rlpipe.flows.rl
    from rlpipe.flows.rl import run_rl
    from rlpipe.storage.tracking import NullTracker
    from rlpipe.tasks.config import validate_config

    tracker = NullTracker()
    monkeypatch.setattr(rlpipe.flows.rl, "make_tracker", lambda *args, **kwargs: tracker)

    # no over-sampling carry (max_staleness 0): the bound is k itself
    config = validate_config(config_dict(tmp_path, f"k{k}", {"off_policy": {"max_steps": k},
                                                             "buffer": {"max_staleness": 0}, "steps": 8}))
    run_rl(config, start_checkpoint=sft_checkpoint)
    run_dir = config.run_dir / "rl"
    low, high, trained, distinct = staleness_report(run_dir)
    assert 0 <= low and high <= k, (low, high)
    assert high >= 1  # generation really ran ahead of training
    assert trained == distinct > 0  # no sample trained twice
    assert untracked_groups(run_dir) == 0
    assert query(run_dir, "select count(distinct step) from train_steps")[0][0] == 8
    # each sync's wait for the round in flight is logged apart from the reload itself
    synced = [metrics for _, metrics in tracker.metrics if "perf/seconds_sync" in metrics]
    assert len(synced) == 8 and all(metrics["perf/seconds_sync_wait"] > 0 for metrics in synced)  # timed at all


def test_carried_groups_stay_within_max_staleness_and_weights_go_out_every_sync_every_steps(
        sft_checkpoint, tmp_path, monkeypatch):  # noqa: F811
    """k = 1 with over-sampling ×2 (tiny.toml): surplus groups are carried to later steps, so a
    trained sample may lag by more than k, up to rl.buffer.max_staleness = 2 and never beyond (older
    groups are dropped as stale, which happens here: the bound bites); and with
    engine.sync_every = 2 the sync stage runs at steps 2, 4, 6 and 8 only."""
    import rlpipe.flows.rl
    from rlpipe.flows.rl import run_rl
    from rlpipe.storage.tracking import NullTracker
    from rlpipe.tasks.config import validate_config

    tracker = NullTracker()
    monkeypatch.setattr(rlpipe.flows.rl, "make_tracker", lambda *args, **kwargs: tracker)
    config = config_dict(tmp_path, "carried", {"off_policy": {"max_steps": 1}, "buffer": {"max_staleness": 2},
                                               "steps": 8})
    config["engine"] = {**config.get("engine", {}), "sync_every": 2}
    config = validate_config(config)
    run_rl(config, start_checkpoint=sft_checkpoint)
    run_dir = config.run_dir / "rl"
    low, high, trained, distinct = staleness_report(run_dir)
    stale = query(run_dir, "select count(*) from groups where status = 'stale'")[0][0]
    assert 0 <= low and high <= 2, (low, high, stale)
    assert high > 1 and stale > 0, f"max lag {high}, {stale} stale groups: the bound was never approached"
    assert trained == distinct > 0
    assert untracked_groups(run_dir) == 0
    synced = sorted(step for step, metrics in tracker.metrics if "perf/seconds_sync" in metrics)
    assert synced == [2, 4, 6, 8], synced


def test_the_sampler_process_keeps_the_bound_and_every_fate(sft_checkpoint, tmp_path):  # noqa: F811
    """engine.producer = "process" (engines/process_engine.py): the rollouts of k = 1 are sampled
    in a child process from shared-memory weights; the flow is needed because the child only
    takes weights at the trainer's syncs, between the producer's rounds."""
    from rlpipe.flows.rl import run_rl
    from rlpipe.tasks.config import validate_config

    config = config_dict(tmp_path, "process", {"off_policy": {"max_steps": 1}, "buffer": {"max_staleness": 0},
                                               "steps": 4})
    config["engine"] = {**config.get("engine", {}), "producer": "process"}
    config = validate_config(config)
    run_rl(config, start_checkpoint=sft_checkpoint)
    run_dir = config.run_dir / "rl"
    low, high, trained, distinct = staleness_report(run_dir)
    assert 0 <= low and high <= 1 and trained == distinct > 0, (low, high, trained, distinct)
    assert untracked_groups(run_dir) == 0
    assert query(run_dir, "select count(distinct step) from train_steps")[0][0] == 4
