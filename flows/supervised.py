"""The order of stages for pretraining and SFT (shared): data → (pack + train) per step →
checkpoint → eval. `flows/pretrain.py` and `flows/sft.py` are the Prefect flows around it.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.envs.timeout import with_reward_timeout
from rlpipe.flows.common import (
    RunState,
    Stopwatch,
    make_tracker,
    open_run,
    registered_model_name,
    run_phase,
    stage_io,
)
from rlpipe.flows.progress import progress
from rlpipe.tasks.checkpoint import checkpoint_task, reloaded_by_vllm_servers
from rlpipe.tasks.config import RunConfig
from rlpipe.tasks.evaluate import eval_metrics, eval_step
from rlpipe.tasks.origin import record_origin
from rlpipe.tasks.ranks import make_trainer
from rlpipe.tasks.record import load_rows, step_metrics, train_step_row
from rlpipe.tasks.setup import (
    engine_dtype,
    make_env,
    make_model_and_tokenizer,
    max_context,
    place_model,
    sft_data,
    stop_token_ids,
)
from rlpipe.tasks.supervised import supervised_train_task
from rlpipe.training import metric_names as m
from rlpipe.training.checkpoint import latest_checkpoint, load_checkpoint
from rlpipe.training.lora import lora_from_config
from rlpipe.training.losses import nll_loss


def due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def run_supervised(config: RunConfig, phase: str, parent_mlflow_run_id: str | None = None,
                   start_checkpoint: str | None = None) -> dict:
    """Train `config.<phase>` (pretrain | sft); returns the final checkpoint and eval metrics."""
    from rlpipe.engines.torch_engine import TorchEngine

    section = getattr(config, phase)
    state: RunState = open_run(config, phase)
    tracker = make_tracker(config, state, parent_mlflow_run_id)

    def body() -> dict:
        record_origin(state.run_dir, state.run_id, start_checkpoint or config.model.path, tracker)
        # tables on one ordered background thread, drained before checkpoints and at the end
        with stage_io(config):
            return _train(config, phase, section, state, tracker, start_checkpoint, TorchEngine)

    return run_phase(state, tracker, body)


def _train(config, phase, section, state, tracker, start_checkpoint, engine_cls) -> dict:
    run_dir, run_id = state.run_dir, state.run_id
    env = with_reward_timeout(make_env(config.task.env, config.task.options), config.task.reward_timeout_s)
    resume_from = latest_checkpoint(run_dir)
    model, tokenizer = make_model_and_tokenizer(
        config.model.preset, start_checkpoint or config.model.path, config.model.overrides, config.seed)
    place_model(model, config.device, config.model.weights_dtype, config.train.activation_checkpointing,
                config.train.compile)
    model = lora_from_config(model, config.model.lora)  # adapters only train (training/lora.py)
    start_step = 0
    if resume_from is not None:
        loaded = load_checkpoint(resume_from, model=model)  # weights, RNG; the optimizer's state below
        start_step = int(loaded.metadata["step"])
    # optimizer after any data-parallel wrapping; `model` then has whole weights (rank 0's view)
    trainer = make_trainer(config, model, section.optim, section.steps, ("nll",), resume_from)
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    if phase == "pretrain":
        from rlpipe.tasks.setup import pretrain_data

        sequences = pretrain_data(env, tokenizer, section, config.seed)
    else:
        sequences = sft_data(env, tokenizer, section.examples, config.seed,
                             max_len=min(max_context(model), section.optim.token_budget),
                             data_path=section.data_path)
    engine = engine_cls(model, dtype=engine_dtype(model, config.model.bf16_autocast))
    eval_examples = list(env.examples("eval", seed=config.seed))[: config.task.eval_examples]
    model_name = registered_model_name(config)
    last_path, eval_metrics, cursor = None, {}, {}
    bar = progress(total=section.steps, initial=start_step, desc=f"{phase}")
    for step in range(start_step + 1, section.steps + 1):
        watch = Stopwatch()
        with watch("train"):
            metrics, cursor = supervised_train_task(
                model, optimizer, scheduler, sequences, nll_loss, step=step, seed=config.seed,
                per_step=section.sequences_per_step, token_budget=section.optim.token_budget,
                normaliser=section.optim.normaliser, max_grad_norm=section.optim.max_grad_norm,
                autocast=config.model.bf16_autocast, parallel=trainer.dp)
        if due(step, section.eval_every, section.steps) and load_rows(run_dir, "evals", step) is None:
            with watch("eval"):
                eval_metrics = eval_step(engine, tokenizer, env, eval_examples, run_dir=run_dir, run_id=run_id,
                                         step=step, max_new_tokens=config.rl.sampling.max_new_tokens,
                                         stop_token_ids=stop_token_ids(tokenizer), max_context=max_context(model))
        # the step's row, then (due) every queued table and the checkpoint that marks the step done
        with watch("checkpoint"):
            row = checkpoint_task(
                train_row=train_step_row(run_id, step, phase, metrics, watch.seconds),
                checkpoint=due(step, section.checkpoint_every, section.steps),
                run_dir=run_dir, run_id=run_id, step=step, policy_version=step, model=model,
                tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                data_state={"cursor": cursor}, metrics=metrics, tracker=tracker,
                model_name=f"{model_name}-{phase}", explicit_lm_head=reloaded_by_vllm_servers(config.engine))
        last_path = row["path"] if row else last_path
        tracker.log_metrics(step_metrics(metrics, {}, watch.seconds) | eval_metrics, step=step)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", **({"acc": f"{eval_metrics[m.EVAL_ACCURACY]:.2f}"} if eval_metrics else {}))
    bar.close()
    trainer.finish()
    if last_path is None:  # nothing left to train: the run was already complete
        last = latest_checkpoint(run_dir)
        last_path = str(last) if last else None
        eval_metrics = _eval_summary(run_dir, section.steps)
    return {"checkpoint": last_path, "eval": eval_metrics, "steps": section.steps}


def _eval_summary(run_dir: Path, step: int) -> dict:
    rows = load_rows(run_dir, "evals", step) or []
    return eval_metrics(rows) if rows else {}
