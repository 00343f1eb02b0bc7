"""The SFT/pretrain order of stages on a resumed step whose evals are stored: the eval stage reads
them back, and their metrics, logged by the run that evaluated them, are not logged again."""

from __future__ import annotations

from types import SimpleNamespace

import rlpipe.flows.supervised as supervised
from rlpipe.core import metric_names as m
from rlpipe.storage.tracking import NullTracker
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.evaluate import StepEvals


def _row(step: int) -> dict:
    return {"run_id": "r", "step": step, "env": "e", "example_id": "x", "reward": 1.0, "correct": True,
            "prompt_text": "", "completion_text": ""}


def test_stored_evals_are_read_back_and_not_logged_twice(tmp_path, monkeypatch):
    stored = {2}  # the step an earlier run evaluated before it stopped
    evaluated = []

    def evaluate(step, *, run_dir, run_id):
        evaluated.append(step)
        return StepEvals([_row(step)], stored=step in stored)

    monkeypatch.setattr(supervised, "supervised_train_task",
                        lambda *args, **kwargs: ({"loss": 1.0, "tokens": 8}, {}))
    monkeypatch.setattr(supervised, "checkpoint_task", lambda **kwargs: {"path": "c", "mlflow_model_version": None} if kwargs["checkpoint"] else None)
    config = RunConfig(sft={"steps": 4, "eval_every": 2, "checkpoint_every": 4})
    trainer = SimpleNamespace(model=None, optimizer=None, scheduler=None, finish=lambda: None)
    run = SimpleNamespace(trainer=trainer, loss_fn=None, sequences=[], tokenizer=None, evaluate=evaluate, start_step=0)
    tracker = NullTracker()
    result = supervised._train(config, "sft", run, SimpleNamespace(run_dir=tmp_path, run_id="r"), tracker)
    assert evaluated == [2, 4] and result["eval"] == {m.EVAL_ACCURACY: 1.0, m.EVAL_REWARD: 1.0}
    logged = {step for step, metrics in tracker.metrics if m.EVAL_ACCURACY in metrics}
    assert logged == {4}


def test_a_complete_run_reads_its_last_evals_back(tmp_path, monkeypatch):
    evaluated = []

    def evaluate(step, *, run_dir, run_id):
        evaluated.append(step)
        return StepEvals([_row(step)], stored=True)

    monkeypatch.setattr(supervised, "latest_checkpoint", lambda run_dir: run_dir / "step_000004")
    config = RunConfig(sft={"steps": 4})
    trainer = SimpleNamespace(model=None, optimizer=None, scheduler=None, finish=lambda: None)
    run = SimpleNamespace(trainer=trainer, tokenizer=None, evaluate=evaluate, start_step=4)
    result = supervised._train(config, "sft", run, SimpleNamespace(run_dir=tmp_path, run_id="r"), NullTracker())
    assert evaluated == [4] and result["eval"] == {m.EVAL_ACCURACY: 1.0, m.EVAL_REWARD: 1.0}
    assert result["checkpoint"] == str(tmp_path / "step_000004")
