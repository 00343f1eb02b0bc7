"""A tiny RL run with `checkpoint.keep_last = 1` and a real MLflow registry: it keeps the newest
checkpoint and the one `best` points to, retires the others' versions, still resumes after a
failure, replays a step forward from what is left, and traces the lineage of a removed version.

It needs the flow (run_rl, without Prefect task runs): retention runs inside the checkpoint stage,
the `best` alias moves after it, and a resumed phase runs a pass before its first step; the unit
tests (tests/unit/test_checkpoint_retention.py) cover the folder contract and kills."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow
MODEL = "retention-test"


class StopAfterStep3(RuntimeError):
    pass


@pytest.fixture(scope="module")
def run(sft_checkpoint, tmp_path_factory):  # noqa: F811
    """4 RL steps, a checkpoint each, evals at 2 and 4; `best` points at step 1 in the first attempt,
    which fails right after step 3's checkpoint (its alias update raises, before that step's
    retention pass); the second resumes from it."""
    import rlpipe.flows.rl as rl_flow
    from rlpipe.storage.writer import compact_run
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    runs = tmp_path_factory.mktemp("retention")
    data = config_dict(runs, "keep1", {"steps": 4, "checkpoint_every": 1, "eval_every": 2})
    data["tracking"] = {"enabled": True, "report": False, "prefect_task_runs": False, "registered_model": MODEL}
    data["checkpoint"] = {"keep_last": 1}
    config = validate_config(data)
    promote = rl_flow.promote_best

    def failing(tracker, model_name, row, accuracy, best):
        if row is not None and row["step"] == 1:  # `best` -> step 1 whatever its eval: a pinned checkpoint
            return promote(tracker, model_name, row, math.inf, best)
        if row is not None and row["step"] == 3:
            raise StopAfterStep3("stopped after step 3's checkpoint")
        return promote(tracker, model_name, row, accuracy, best)

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.setattr(rl_flow, "promote_best", failing)
        with pytest.raises(StopAfterStep3):
            rl_flow.run_rl(config, start_checkpoint=sft_checkpoint)
        rl_dir = config.run_dir / "rl"
        after_failure = sorted(p.name for p in (rl_dir / "checkpoints").iterdir())
        # the closed steps' tables compacted (ranges of 2 steps here, 100 in a run): the resume, replay,
        # lineage and report below read merged and fresh partitions alike
        counts = _counts(rl_dir)
        assert compact_run(rl_dir, closed=3, width=2)
        assert _counts(rl_dir) == counts
        patch.setattr(rl_flow, "promote_best", promote)
        result = rl_flow.run_rl(config, start_checkpoint=sft_checkpoint)
    return runs, rl_dir, after_failure, result


def _counts(run_dir) -> dict:
    from rlpipe.storage.catalog import connect

    con = connect([run_dir])
    return {table: con.sql(f"select step, count(*) from {table} group by 1 order by 1").fetchall()
            for table in ("rollouts", "scores", "groups", "train_steps", "train_tokens", "checkpoints", "evals",
                          "fates")}


def _client(runs):
    from mlflow import MlflowClient

    uri = f"sqlite:///{runs / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_keeps_the_newest_and_the_best_and_retires_the_rest(run):
    from rlpipe.training.checkpoint_files import checkpoint_steps, verify_checkpoint

    runs, rl_dir, after_failure, result = run
    # step 1 pinned by `best`, step 2 the newest at its pass, step 3 written before the failure
    assert after_failure == ["step_000001", "step_000002", "step_000003"]
    client = _client(runs)
    best = client.get_model_version_by_alias(MODEL, "best")
    kept = checkpoint_steps(rl_dir)
    assert kept == {4, int(best.tags["step"])}, kept
    assert result["checkpoint"].endswith("step_000004")
    assert not [p for p in (rl_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    for version in client.search_model_versions(f"name = '{MODEL}'"):
        removed = "rlpipe.weights_removed" in version.tags
        assert removed == (int(version.tags["step"]) not in kept), version.tags
        if removed:
            assert "checkpoint.keep_last = 1" in version.tags["rlpipe.weights_removed"]
    for step in kept:
        verify_checkpoint(rl_dir / "checkpoints" / f"step_{step:06d}")
    # the resume started from step 3 and trained step 4 once: one train_steps row per step
    from rlpipe.storage.catalog import connect

    steps = connect([rl_dir]).sql("select step, count(*) from train_steps group by 1 order by 1").fetchall()
    assert steps == [(1, 1), (2, 1), (3, 1), (4, 1)]
    from rlpipe.storage.compaction import compacted_files, fresh_files

    assert "steps=2-3" in [p.parent.name for p in compacted_files(rl_dir, "rollouts")]
    assert [step for step, _ in fresh_files(rl_dir, "rollouts")] == [4]
    # every sampled completion once, with its fate, merged steps and fresh alike; the report reads them
    fates = connect([rl_dir]).sql("select count(*), count(distinct sample_id) from fates").fetchall()[0]
    assert fates[0] == fates[1] == connect([rl_dir]).sql("select count(*) from rollouts").fetchall()[0][0]
    from rlpipe.dashboards.report import write_report

    assert write_report([rl_dir]).is_file()
    assert (rl_dir / "checkpoints" / "step_000004" / "optimizer.pt").is_file()


def test_replay_goes_forward_from_what_is_left_and_says_why(run, capsys):
    from rlpipe.flows.cli import main

    _, rl_dir, _, _ = run
    code = main(["replay", str(rl_dir), "--step", "3"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0, text
    # step 2 (removed by the resumed phase's first pass) was a checkpoint: the replay says why it
    # cannot start there, and goes forward from the starting weights (step 1 has no optimizer state)
    assert "the checkpoint of step 2 was removed (checkpoint retention, checkpoint.keep_last): not a start" in text
    assert "replaying steps 1..3 forward from the starting weights" in text
    assert "OK: step 3 matches bit for bit" in text


def test_lineage_of_a_removed_version_names_it_and_still_traces_the_data(run, capsys):
    from rlpipe.storage.lineage import main

    runs, _, _, _ = run
    client = _client(runs)
    removed = [v for v in client.search_model_versions(f"name = '{MODEL}'") if "rlpipe.weights_removed" in v.tags]
    assert removed
    version = min(removed, key=lambda v: int(v.version))
    assert main([f"models:/{MODEL}/{version.version}", "--runs-root", str(runs)]) == 0
    text = capsys.readouterr().out
    assert "  weights      removed: checkpoint retention (checkpoint.keep_last = 1)" in text
    assert "trained" in text and "sampled" in text
    assert main([f"models:/{MODEL}/{version.version}", "--runs-root", str(runs), "--format", "json"]) == 0
    chain = json.loads(capsys.readouterr().out)
    assert chain[0]["weights_removed"].startswith("checkpoint retention") and chain[0]["train"]["steps"] >= 1
