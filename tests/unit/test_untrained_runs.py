"""A run that trains nothing says so: the share of samples trained in the progress line, a warning
line for a step that trained none, and a verdict line with exit 1 for a run none of whose RL steps
trained (flows/rl.py, tasks/step_rows.py, flows/runner.py)."""

from __future__ import annotations

from types import SimpleNamespace

from rlpipe.tasks.config import validate_config
from rlpipe.tasks.step_rows import (
    trained_before,
    trained_samples,
    trained_share,
    untrained_step_warning,
)

FATES = {"rollout/fate_trained": 16.0, "rollout/fate_zero_variance": 48.0, "rollout/fate_carried": 8.0,
         "rollout/fate_stale": 0.0, "rollout/reward_mean": 0.5}


def test_trained_samples_count_non_zero_advantages_of_the_decided_completions():
    samples = [SimpleNamespace(advantage=a) for a in (0.5, -0.5, 0.0, 0.0)]
    assert trained_samples(samples) == 2
    assert trained_share(16, FATES) == "25% of 64"  # carried completions are not decided yet
    assert trained_share(0, {}) == "0 of 0"


def test_a_step_that_trained_nothing_says_what_became_of_its_completions():
    line = untrained_step_warning(3, {"rollout/fate_zero_variance": 60.0, "rollout/fate_truncated": 4.0,
                                      "rollout/fate_carried": 8.0})
    assert line == ("rlpipe: warning: RL step 3 trained on no sample, its weights are unchanged (its completions' "
                    "fates: zero_variance 60, truncated 4); rewards must differ within a group to train")


def test_trained_before_reads_the_train_steps_rows(tmp_path):
    from rlpipe.storage.stage_tables import persist_now
    from rlpipe.tasks.step_rows import train_step_row

    for step, tokens in ((1, 0), (2, 0), (3, 120)):
        persist_now(tmp_path, "train_steps", step, [train_step_row("r", step, "rl", {"tokens": tokens}, {})], "r")
    assert not trained_before(tmp_path, 0)
    assert not trained_before(tmp_path, 2)
    assert trained_before(tmp_path, 3)


def _config(tmp_path, flow: str):
    return validate_config({"runs_root": str(tmp_path), "run_name": "untrained", "flow": flow})


def test_the_verdict_names_a_run_whose_rl_trained_nothing(tmp_path):
    from rlpipe.flows.runner import untrained_verdict

    pipeline, rl = _config(tmp_path, "pipeline"), _config(tmp_path, "rl")
    verdict = untrained_verdict(pipeline, {"sft": {"trained": True}, "rl": {"steps": 4, "trained": False}})
    assert verdict.startswith("rlpipe: RL trained on no sample in its 4 steps:")
    assert "no RL checkpoint was registered" in verdict
    assert untrained_verdict(rl, {"steps": 2, "trained": False}) is not None
    assert untrained_verdict(rl, {"steps": 2, "trained": True}) is None
    assert untrained_verdict(rl, {"steps": 2}) is None  # a result saved before runs recorded it
    assert untrained_verdict(_config(tmp_path, "sft"), {"steps": 2, "trained": False}) is None


def test_a_run_that_trained_nothing_exits_1_after_its_summary(tmp_path, monkeypatch, capsys):
    from rlpipe.flows import runner

    monkeypatch.setattr(runner, "start", lambda config, resume=False: {"steps": 2, "trained": False, "eval": {}})
    assert runner._execute_flow(_config(tmp_path, "rl"), overwrite=False) == 1
    out, err = capsys.readouterr()
    assert "rl run finished" in out
    assert err.strip().startswith("rlpipe: RL trained on no sample in its 2 steps")
    monkeypatch.setattr(runner, "start", lambda config, resume=False: {"steps": 2, "trained": True, "eval": {}})
    assert runner._execute_flow(_config(tmp_path, "rl"), overwrite=False) == 0
