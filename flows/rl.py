"""Prefect flow `rl`: the GRPO-family loop, the stages of a step in order and nothing else.

    rollouts (generate → score → filter/advantages) → pack → train → eval → checkpoint → sync

Where rollouts come from — sampling rounds, over-sampling, carry-over, the staleness bound, and
with `rl.off_policy.max_steps >= 1` generation running ahead of training — is rollouts/source.py;
each stage writes its own table (tasks/). The checkpoint stage puts every table of the step on
disk before the checkpoint that marks it done, so a killed run resumes where it stopped.

    rlpipe run configs/rl.toml
"""

from __future__ import annotations

import math
import sys
from contextlib import ExitStack
from dataclasses import replace

from prefect import flow
from rlpipe.core import metric_names as m
from rlpipe.core.timing import Stopwatch
from rlpipe.flows.common import (
    already_finished,
    finished_result,
    make_tracker,
    open_run,
    phase_run_dir,
    registered_model_name,
    run_phase,
    stage_io,
    write_run_report,
)
from rlpipe.flows.progress import progress
from rlpipe.flows.run_folders import flow_run_folder, name_flow_run
from rlpipe.flows.supervised import due
from rlpipe.rollouts.group_buffer import BatchFillError
from rlpipe.storage.stage_tables import stored_row
from rlpipe.tasks.checkpoint import (
    TrainingState,
    after_checkpoint,
    checkpoint_task,
    complete_registrations,
    promote_best,
    register_options,
)
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.evaluate import best_accuracy_before, step_accuracy
from rlpipe.tasks.origin import origin_task
from rlpipe.tasks.pack import pack_task
from rlpipe.tasks.rl_setup import RLRun, open_rl
from rlpipe.tasks.step_rows import (
    step_metrics,
    train_step_row,
    trained_before,
    trained_samples,
    trained_share,
    untrained_step_warning,
)
from rlpipe.tasks.sync import sync_task
from rlpipe.tasks.train import train_task
from rlpipe.training.checkpoint_files import checkpoint_steps, latest_checkpoint
from rlpipe.training.checkpoint_io import CheckpointRecord


@flow(name="rl", flow_run_name=name_flow_run, log_prints=True, persist_result=False)
def rl_flow(config_path: str | None = None, overrides: list[str] | None = None,
            config: dict | None = None, resume: bool = False, overwrite: bool = False) -> dict:
    """RL from `model.path` (e.g. an SFT checkpoint) or a preset; returns the last checkpoint.
    resume / overwrite: act on an existing run folder (flows/run_folders.py `run_folder`)."""
    with flow_run_folder(config_path, overrides, config, resume=resume, overwrite=overwrite) as cfg:
        if (done := already_finished(phase_run_dir(cfg, "rl"))) is not None:
            return done
        result = run_rl(cfg)
    write_run_report(cfg, [phase_run_dir(cfg, "rl")])
    return result


def run_rl(config: RunConfig, parent_mlflow_run_id: str | None = None,
           start_checkpoint: str | None = None) -> dict:
    """The RL phase; a phase that already finished returns its saved result untouched."""
    if (done := finished_result(phase_run_dir(config, "rl"))) is not None:
        return done
    state = open_run(config, "rl")
    tracker = make_tracker(config, state, parent_mlflow_run_id)

    def body() -> dict:
        # leaving stage_io drains the table writer: a phase is marked done only with its tables
        with stage_io(config), ExitStack() as stack:
            origin_task(start_checkpoint or config.model.path, tracker, run_dir=state.run_dir, run_id=state.run_id)
            run = open_rl(config, state.run_dir, state.run_id, start_checkpoint)
            stack.callback(run.close)
            return _loop(config, run, stack.enter_context(run.source), tracker, dict(run_dir=state.run_dir,
                                                                                     run_id=state.run_id))
    return run_phase(state, tracker, body)


def _step_batch(source, step: int, tracker, buffer):
    """The step's rollouts; a step that cannot fill its batch logs its fate counters (over_cap
    included) before the run stops, so MLflow still equals the fates rows, and names the settings
    that let a resume go on (`fill_settings`)."""
    try:
        return source.batch(step)
    except BatchFillError as error:
        tracker.log_metrics(getattr(error, "metrics", {}), step=step)
        error.resume_settings = fill_settings(buffer)
        raise


def fill_settings(buffer) -> list[str]:
    """The `rlpipe resume --set` settings that let a step which could not fill its batch go on:
    twice the sampling rounds, training on the valid groups they find (runner.py's advice)."""
    return [f"rl.buffer.max_attempts={2 * buffer.max_attempts}", "rl.buffer.partial_batches=true"]


def _registering(saving, trained: bool):
    """The checkpoint options of a step: registered once any step trained on a sample; until
    then the weights are the start's, and their checkpoints are saved but not registered."""
    return saving if trained else replace(saving, model_name=None)


def _loop(config: RunConfig, run: RLRun, source, tracker, io: dict) -> dict:
    rl, model_name = config.rl, registered_model_name(config)
    saving = register_options(config.engine, model_name, config.checkpoint.keep_last)
    saved = TrainingState(run.model, run.tokenizer, run.trainer.optimizer, run.trainer.scheduler)
    trained = trained_before(io["run_dir"], run.start_step)  # a checkpoint of untrained weights is not registered
    # a kill between a checkpoint's rename and its registration: completed before going on
    complete_registrations(tracker=tracker, options=_registering(saving, trained), **io)
    evals = run.evaluate(0, **io) if run.start_step == 0 else {}
    best, last = evals.get(m.EVAL_ACCURACY, -math.inf), None
    if run.start_step:  # a resumed run moves the `best` alias only for a better eval than before,
        # the resumed checkpoint's included (a kill may have fallen before its alias moved)
        best = best_accuracy_before(io["run_dir"], run.start_step - 1, checkpoint_steps(io["run_dir"]))
        best = promote_best(tracker, model_name, stored_row(io["run_dir"], "checkpoints", run.start_step),
                            step_accuracy(io["run_dir"], run.start_step), best)
    if evals:
        tracker.log_metrics(evals, step=0)
    bar = progress(total=rl.steps, initial=run.start_step, desc="rl")
    for step in range(run.start_step + 1, rl.steps + 1):
        batch = _step_batch(source, step, tracker, rl.buffer)  # generate → score → filter/advantages, each writing its table
        if not (n_trained := trained_samples(batch.samples)):
            bar.write(untrained_step_warning(step, batch.metrics), file=sys.stderr)
        trained = trained or n_trained > 0
        watch, version, step_evals = Stopwatch(batch.seconds), step * rl.loss.ppo_epochs, {}
        with watch("pack"):
            batches = pack_task(batch.samples, rl.optim.token_budget, step=step, budget=run.trainer.budget, **io)
        with watch("train"):  # writes train_tokens: the batches and the trainer's log-probs (replay, tokens view)
            train = train_task(run.trainer, batches, run.loss_fn, samples=batch.samples, trainer_logprobs={},
                               step=step, **io)
        if due(step, rl.eval_every, rl.steps):
            with watch("eval"):
                step_evals = evals = run.evaluate(step, **io)
        tracker.log_metrics(step_metrics(train, batch.metrics, watch.seconds) | step_evals
                            | {m.TRAINED_SAMPLES: float(n_trained)}, step=step)
        sync = step % config.engine.sync_every == 0
        with watch("checkpoint"):  # the step's tables on disk, then the checkpoint marking it done
            row = checkpoint_task(train_row=train_step_row(io["run_id"], step, "rl", train, watch.seconds),
                                  checkpoint=due(step, rl.checkpoint_every, rl.steps)
                                  or (sync and run.needs_checkpoint_to_sync), state=saved,
                                  record=CheckpointRecord(batch.state, train, policy_version=version),
                                  tracker=tracker, options=_registering(saving, trained),
                                  step=step, **io)
        best = promote_best(tracker, model_name, row, step_evals.get(m.EVAL_ACCURACY), best)
        if row:  # checkpoint.keep_last once `best` points where it will; the closed steps' tables compacted
            after_checkpoint(tracker=tracker, options=saving, run_dir=io["run_dir"], step=step)
        last = row["path"] if row else last
        if sync:  # between two sampling rounds of an async producer; later rounds record `version`
            with ExitStack() as round_done:
                with watch("sync_wait"):  # for the round in flight (async); timed apart from the reload
                    round_done.enter_context(source.syncing(version))
                with watch("sync"):
                    sync_task(run.engines, last if run.needs_checkpoint_to_sync else None, version, step=step,
                              retries=config.engine.retries, **io)
        elif run.engines[0].shares_weights:
            source.publish(version)  # the engines now sample from this step's weights
        tracker.log_metrics({m.seconds(k): watch.seconds[k] for k in ("checkpoint", "sync", "sync_wait")
                             if k in watch.seconds},
                            step=step)
        bar.update(1)
        bar.set_postfix(reward=f"{batch.metrics.get(m.REWARD_MEAN, 0):.2f}",
                        trained=trained_share(n_trained, batch.metrics),
                        **({"acc": f"{step_evals[m.EVAL_ACCURACY]:.2f}"} if step_evals else {}))
    bar.close()
    run.trainer.finish()
    last = last or latest_checkpoint(io["run_dir"])
    # trained: whether any step of the run trained on a sample (runner.py ends a run that did not)
    return {"checkpoint": str(last) if last else None, "eval": evals, "steps": rl.steps, "trained": trained}
