"""The pass-rate curriculum in a real RL flow, the tiny config on a pool of 6 prompts
(rl.prompt_pool) so that they repeat: solved prompts are skipped with a recorded reason, the canned query answers, and a
run resumed from a checkpoint skips and samples exactly what the uninterrupted run did (its pass
history rebuilt from the tables). It needs the flow: the rows come from the filter/advantages
stage and the history from the stored `rollouts` and `scores` of a resumed run."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

RL = {"steps": 4, "checkpoint_every": 2, "eval_every": 0, "curriculum": {"type": "pass_rate", "retest": 0.2},
      "buffer": {"partial_batches": True, "max_attempts": 3}, "prompt_pool": 6}


def curriculum_config(root, name):
    return config_dict(root, name, RL)


def test_skips_are_recorded_answered_and_replayed_exactly_on_resume(sft_checkpoint, tmp_path):  # noqa: F811
    from rlpipe.flows.rl import run_rl
    from rlpipe.storage.queries import run_canned, run_sql
    from rlpipe.tasks.config import validate_config

    config = validate_config(curriculum_config(tmp_path, "whole"))
    run_rl(config, start_checkpoint=sft_checkpoint)
    rl_dir = config.run_dir / "rl"
    rows = run_sql([rl_dir], "select step, attempt, env, example_id, status, state, passed, counted, reason "
                             "from curriculum order by all").to_pylist()
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert any(r["step"] > 2 for r in skipped), "the tiny policy solves some of the 6 prompts: they rest"
    for r in skipped:
        assert r["counted"] == 8 and r["passed"] in (0, 8)
        assert r["state"] == ("solved" if r["passed"] == 8 else "hopeless")
        assert r["reason"].startswith(f"{r['state']}: {r['passed']} of its last 8 completions passed")
    # a skipped prompt was not sampled by the round that skipped it
    sampled = {(r["step"], r["attempt"], r["example_id"]) for r in run_sql(
        [rl_dir], "select distinct step, attempt, example_id from rollouts").to_pylist()}
    assert all((r["step"], r["attempt"], r["example_id"]) not in sampled for r in skipped)
    pool = {f"train/0/{i}" for i in range(6)}  # the first 6 train examples (seed 0)
    assert {r["example_id"] for r in rows} <= pool
    answer = run_canned([rl_dir], "pass_rate_by_prompt").to_pylist()
    assert {r["example_id"] for r in answer} <= pool
    assert {r["example_id"] for r in answer} == {r["example_id"] for r in run_sql(
        [rl_dir], "select distinct example_id from rollouts").to_pylist()}
    assert sum(r["n_samples"] for r in answer) == run_sql([rl_dir], "select count(*) n from scores").to_pylist()[0]["n"]

    assert_resume_replays(config.run_dir, curriculum_config(tmp_path, "copy"), sft_checkpoint)


def assert_resume_replays(run_dir, copy_config: dict, checkpoint: str) -> None:
    """The run stopped after step 2's checkpoint: a resume rebuilds the history from the tables and
    skips and samples exactly what the uninterrupted run did."""
    from rlpipe.flows.rl import run_rl
    from rlpipe.storage.queries import run_sql
    from rlpipe.storage.snapshots import commit, listed
    from rlpipe.tasks.config import validate_config

    copy = run_dir.parent / copy_config["run_name"]
    shutil.copytree(run_dir, copy)
    copy_rl = copy / "rl"
    shutil.rmtree(copy_rl / "checkpoints" / "step_000004")
    state = json.loads((copy_rl / "run.json").read_text())
    (copy_rl / "run.json").write_text(json.dumps({**state, "status": "running"}))
    for table in ("rollouts", "scores", "curriculum", "decisions"):
        folder = copy_rl / "tables" / table
        for part in folder.glob("step=*"):
            if int(part.name.split("=")[1]) > 2:
                shutil.rmtree(part)
        # the table's snapshot as it stood after step 2: what is left on disk (storage/snapshots.py)
        commit(folder, lambda _current, folder=folder: listed(folder), durable=True)
    run_rl(validate_config(copy_config), start_checkpoint=checkpoint)
    query = "select step, attempt, example_id, status, reason from curriculum where step > 2 order by all"
    assert run_sql([copy_rl], query).to_pylist() == run_sql([run_dir / "rl"], query).to_pylist()
    again = "select step, sample_id, example_id from rollouts where step > 2 order by all"
    assert run_sql([copy_rl], again).to_pylist() == run_sql([run_dir / "rl"], again).to_pylist()


CLASS_RL = {"steps": 4, "checkpoint_every": 2, "eval_every": 0,
            "curriculum": {"type": "pass_rate", "key": "class", "window": 16, "pass_reward": 0.0, "retest": 0.2},
            "buffer": {"partial_batches": True, "max_attempts": 3}}
"""Keyed by class on the whole train split (prompts that never repeat); every reward passes
(pass_reward 0), so each class rests once 16 of its completions are scored."""


def test_classes_rest_across_new_prompts_and_a_resume_rebuilds_the_class_history(sft_checkpoint, tmp_path):  # noqa: F811
    """Needs the flow: the resumed run maps its stored rollouts back to their classes through the
    prompt pool (tasks/rl_setup.py) and must skip exactly what the uninterrupted run did."""
    from rlpipe.flows.rl import run_rl
    from rlpipe.storage.queries import run_sql
    from rlpipe.tasks.config import validate_config

    config = validate_config(config_dict(tmp_path, "classes", CLASS_RL))
    run_rl(config, start_checkpoint=sft_checkpoint)
    rl_dir = config.run_dir / "rl"
    skipped = run_sql([rl_dir], "select example_id, state, passed, counted, reason from curriculum "
                                "where status = 'skipped'").to_pylist()
    sampled = {r["example_id"] for r in run_sql([rl_dir], "select distinct example_id from rollouts").to_pylist()}
    assert skipped, "every class whose 16 completions passed rests"
    for r in skipped:
        assert (r["state"], r["passed"], r["counted"]) == ("solved", 16, 16)
        assert "of the last 16 completions of its class '+ " in r["reason"]
        assert r["example_id"] not in sampled  # a new prompt, skipped for its class's history
    assert_resume_replays(config.run_dir, config_dict(tmp_path, "classes-copy", CLASS_RL), sft_checkpoint)
