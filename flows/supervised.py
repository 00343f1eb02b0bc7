"""The order of stages for pretraining and SFT (shared): data → (pack + train) per step →
checkpoint → eval. `flows/pretrain.py` and `flows/sft.py` are the Prefect flows around it.
"""

from __future__ import annotations

from rlpipe.core import metric_names as m
from rlpipe.core.timing import Stopwatch
from rlpipe.flows.common import (
    RunState,
    finished_result,
    make_tracker,
    open_run,
    phase_run_dir,
    registered_model_name,
    run_phase,
    stage_io,
)
from rlpipe.flows.progress import progress
from rlpipe.tasks.checkpoint import (
    TrainingState,
    after_checkpoint,
    checkpoint_task,
    complete_registrations,
    promote_best,
    register_options,
)
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.evaluate import best_accuracy_before
from rlpipe.tasks.origin import origin_task
from rlpipe.tasks.step_rows import step_metrics, train_step_row
from rlpipe.tasks.supervised_setup import SupervisedRun, open_supervised
from rlpipe.tasks.supervised_steps import supervised_train_task
from rlpipe.training.checkpoint_files import checkpoint_steps, latest_checkpoint
from rlpipe.training.checkpoint_io import CheckpointRecord


def due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action (eval, checkpoint) falls on `step`: every `every` steps and the last."""
    return step == last or (every > 0 and step % every == 0)


def run_supervised(config: RunConfig, phase: str, parent_mlflow_run_id: str | None = None,
                   start_checkpoint: str | None = None) -> dict:
    """Train `config.<phase>` (pretrain | sft); returns the final checkpoint and eval metrics (a
    phase that already finished: its saved ones, the phase left untouched)."""
    if (done := finished_result(phase_run_dir(config, phase))) is not None:
        return done
    state: RunState = open_run(config, phase)
    tracker = make_tracker(config, state, parent_mlflow_run_id)

    def body() -> dict:
        # tables on one ordered background thread, drained before checkpoints and at the end
        with stage_io(config):
            origin_task(start_checkpoint or config.model.path, tracker, run_dir=state.run_dir, run_id=state.run_id)
            run = open_supervised(config, phase, state.run_dir, start_checkpoint)
            return _train(config, phase, run, state, tracker)

    return run_phase(state, tracker, body)


def _train(config: RunConfig, phase: str, run: SupervisedRun, state: RunState, tracker) -> dict:
    """The phase's steps in order: (pack + train) → eval when due → checkpoint; the `best` alias
    of `NAME-<phase>` moves to a checkpoint whose eval beats every earlier checkpointed eval."""
    section, run_dir, run_id = getattr(config, phase), state.run_dir, state.run_id
    trainer, model_name = run.trainer, f"{registered_model_name(config)}-{phase}"
    saving = register_options(config.engine, model_name, config.checkpoint.keep_last)
    saved = TrainingState(trainer.model, run.tokenizer, trainer.optimizer, trainer.scheduler)
    # a kill between a checkpoint's rename and its registration: completed before going on
    complete_registrations(run_dir=run_dir, run_id=run_id, tracker=tracker, options=saving)
    last_path, eval_metrics, cursor = None, {}, {}
    best = best_accuracy_before(run_dir, run.start_step, checkpoint_steps(run_dir))
    bar = progress(total=section.steps, initial=run.start_step, desc=f"{phase}")
    for step in range(run.start_step + 1, section.steps + 1):
        watch = Stopwatch()
        with watch("train"):
            metrics, cursor = supervised_train_task(trainer, run.sequences, run.loss_fn, step=step, seed=config.seed,
                                                    per_step=section.sequences_per_step,
                                                    token_budget=section.optim.token_budget)
        accuracy = None
        if due(step, section.eval_every, section.steps):
            with watch("eval"):  # a resumed step's stored evals are read back, not evaluated again
                evals = run.evaluate(step, run_dir=run_dir, run_id=run_id)
            accuracy = evals.metrics[m.EVAL_ACCURACY]  # stored or not: its checkpoint is written now
            if not evals.stored:  # stored evals were logged by the run that evaluated them
                eval_metrics = evals.metrics
        # the step's row, then (due) every queued table and the checkpoint that marks the step done
        with watch("checkpoint"):
            row = checkpoint_task(
                train_row=train_step_row(run_id, step, phase, metrics, watch.seconds),
                checkpoint=due(step, section.checkpoint_every, section.steps),
                run_dir=run_dir, run_id=run_id, step=step, state=saved,
                record=CheckpointRecord({"cursor": cursor}, metrics, policy_version=step), tracker=tracker,
                options=saving)
        best = promote_best(tracker, model_name, row, accuracy, best)
        if row:  # checkpoint.keep_last once `best` points where it will; the closed steps' tables compacted
            after_checkpoint(run_dir=run_dir, step=step, tracker=tracker, options=saving)
        last_path = row["path"] if row else last_path
        tracker.log_metrics(step_metrics(metrics, {}, watch.seconds) | eval_metrics, step=step)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", **({"acc": f"{eval_metrics[m.EVAL_ACCURACY]:.2f}"} if eval_metrics else {}))
    bar.close()
    trainer.finish()
    if last_path is None:  # nothing left to train: the run was already complete
        last = latest_checkpoint(run_dir)
        last_path = str(last) if last else None
        eval_metrics = run.evaluate(section.steps, run_dir=run_dir, run_id=run_id).metrics  # read back
    return {"checkpoint": last_path, "eval": eval_metrics, "steps": section.steps}
