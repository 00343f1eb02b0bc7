"""Prefect flow `rl`: the GRPO-family loop, one Prefect task per stage per step.

    generate → score → filter/advantages → pack → train → checkpoint → sync   (+ eval)

Over-sampling: a step samples `oversample_factor` × the groups it still needs; zero-variance
groups are dropped and counted, surplus valid groups carry to the next step, and after
`max_attempts` rounds the step fails with a clear error. Every stage writes its table; on resume,
generate and score read their rows back instead of recomputing, and the rest replays
deterministically, so a killed-and-resumed run ends with the same weights as an uninterrupted one.

    rlpipe run configs/rl.toml
"""

from __future__ import annotations

import math

from prefect import flow

from flows.common import (
    RunState,
    Stopwatch,
    make_tracker,
    open_run,
    phase_run_dir,
    registered_model_name,
    resolve_config,
    run_phase,
    stage_io,
    write_run_report,
)
from flows.config import RunConfig
from flows.progress import progress
from flows.supervised import due
from tasks.advantages import (
    advantage_config,
    filter_task,
    new_buffer,
    prompts_to_sample,
    scored_groups,
)
from tasks.checkpoint import checkpoint_task
from tasks.evaluate import eval_task
from tasks.generate import generate_stage
from tasks.pack import pack_task
from tasks.record import drain_writes, load_rows, persist, train_step_row
from tasks.score import score_stage
from tasks.setup import (
    engine_dtype,
    make_env,
    make_model_and_tokenizer,
    make_optimizer,
    max_context,
    place_model,
    stop_token_ids,
)
from tasks.sync import raise_failed, sync_task
from tasks.train import train_task
from training.checkpoint import latest_checkpoint, load_checkpoint
from training.lora import lora_from_config


@flow(name="rl", log_prints=True, persist_result=False)
def rl_flow(config_path: str | None = None, overrides: list[str] | None = None,
            config: dict | None = None) -> dict:
    """RL from `model.path` (e.g. an SFT checkpoint) or a preset; returns the last checkpoint."""
    cfg = resolve_config(config_path, overrides, config)
    result = run_rl(cfg)
    write_run_report(cfg, [phase_run_dir(cfg, "rl")])
    return result


def run_rl(config: RunConfig, parent_mlflow_run_id: str | None = None,
           start_checkpoint: str | None = None) -> dict:
    state: RunState = open_run(config, "rl")
    tracker = make_tracker(config, state, parent_mlflow_run_id)
    engines: list = []

    def body() -> dict:
        # tables are written on one ordered background thread; leaving the block drains it, so
        # the phase is marked finished (or failed) only once its tables are on disk
        with stage_io(config):
            return _loop(config, state, tracker, start_checkpoint, engines)

    try:
        return run_phase(state, tracker, body)
    finally:
        for engine in engines:
            engine.close()


def make_engines(config: RunConfig, model) -> list:
    if config.engine.type == "torch":
        from engines.torch_engine import TorchEngine

        return [TorchEngine(model, dtype=engine_dtype(model, config.model.bf16_autocast))]
    if config.engine.type == "http":
        from engines.http import engines_from_config

        return engines_from_config(config.engine)
    from engines.vllm_engine import VllmEngine  # optional extra, needs a GPU

    return [VllmEngine(model)]


def _loop(config: RunConfig, state: RunState, tracker, start_checkpoint, engines: list) -> dict:
    from engines.base import SamplingParams
    from envs.prompts import PromptSource
    from training.kl import frozen_copy
    from training.rl_loss import build_rl_loss, loss_normaliser

    rl, run_dir, run_id = config.rl, state.run_dir, state.run_id
    env = make_env(config.task.env, config.task.options)
    model, tokenizer = make_model_and_tokenizer(
        config.model.preset, start_checkpoint or config.model.path, config.model.overrides, config.seed)
    place_model(model, config.device, config.model.weights_dtype, config.train.activation_checkpointing)
    model = lora_from_config(model, config.model.lora)  # adapters only train (training/lora.py)
    optimizer, scheduler = make_optimizer(model, rl.optim, rl.steps * rl.ppo_epochs)
    ref_model = frozen_copy(model) if rl.kl_coef > 0 else None  # the start, before a resume loads
    prompts = PromptSource(env.examples("train", seed=config.seed), seed=config.seed)
    buffer = new_buffer(rl)
    start_step = 0
    resume_from = latest_checkpoint(run_dir)
    if resume_from is not None:
        loaded = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
        start_step = int(loaded.metadata["step"])
        prompts.load_state_dict(loaded.data_state["prompts"])
        buffer.load_state_dict(loaded.data_state["buffer"])
    engines += make_engines(config, model)
    # evals read the trainer's weights in-process: servers may lag a step behind
    eval_engine = engines[0] if config.engine.type != "http" else _local_engine(model, config)
    if resume_from is not None and config.engine.type == "http":
        raise_failed(sync_task(engines, str(resume_from), start_step * rl.ppo_epochs, run_id=run_id,
                               step=start_step, retries=config.engine.retries))
    stops = stop_token_ids(tokenizer)
    sampling = SamplingParams(n=rl.group_size, temperature=rl.sampling.temperature, top_p=rl.sampling.top_p,
                              top_k=rl.sampling.top_k, max_new_tokens=rl.sampling.max_new_tokens,
                              stop_token_ids=stops)
    loss_fn = build_rl_loss(rl.loss, epsilon_low=rl.epsilon_low, epsilon_high=rl.epsilon_high,
                            tis_cap=rl.tis_cap, cispo_cap=rl.cispo_cap, kl_coef=rl.kl_coef,
                            kl_estimator=rl.kl_estimator)
    normaliser, constant = loss_normaliser(rl.loss, rl.optim.normaliser, rl.prompts_per_step * rl.group_size,
                                           rl.sampling.max_new_tokens)
    context = max_context(model)
    eval_examples = list(env.examples("eval", seed=config.seed))[: config.task.eval_examples]
    examples_by_id: dict = {}
    rows_by_sample: dict[str, dict] = {}
    adv_config = advantage_config(rl)
    model_name = registered_model_name(config)
    common = dict(run_dir=run_dir, run_id=run_id)

    def evaluate(step: int) -> dict:
        rows = load_rows(run_dir, "evals", step)
        if rows is None:
            rows, _ = eval_task(eval_engine, tokenizer, env, eval_examples, run_id=run_id, step=step,
                                max_new_tokens=rl.sampling.max_new_tokens, stop_token_ids=stops,
                                max_context=context)
            persist(run_dir, "evals", step, rows, run_id)
            model.train()
        n = max(len(rows), 1)
        return {"eval/accuracy": sum(r["correct"] for r in rows) / n,
                "eval/reward_mean": sum(r["reward"] for r in rows) / n}

    best = -math.inf
    eval_metrics = {}
    if start_step == 0:
        eval_metrics = evaluate(0)
        tracker.log_metrics(eval_metrics, step=0)
        best = eval_metrics["eval/accuracy"]
    last_path = None
    bar = progress(total=rl.steps, initial=start_step, desc="rl")
    for step in range(start_step + 1, rl.steps + 1):
        watch = Stopwatch()
        version = (step - 1) * rl.ppo_epochs
        sampled, scored, decisions = [], [], []
        buffer.start_batch(version)
        while buffer.need() > 0:
            if rl.partial_batches and buffer.attempts >= rl.max_attempts:
                break  # train on what the rounds found
            attempt = buffer.begin_attempt()  # BatchFillError once max_attempts are spent
            examples = prompts.next_batch(prompts_to_sample(buffer))
            examples_by_id.update({e.example_id: e for e in examples})
            with watch("generate"):
                new = generate_stage(engines, tokenizer, env, examples, sampling, previous=sampled,
                                     seed=config.seed, step=step, attempt=attempt, policy_version=version,
                                     max_context=context, **common)
            with watch("score"):
                new_scores = score_stage(env, examples_by_id, new, previous=scored, step=step,
                                         max_error_fraction=rl.max_reward_error_fraction,
                                         length_penalty=overlong_penalty_fn(rl), **common)
            sampled, scored = sampled + new, scored + new_scores
            rows_by_sample.update({row["sample_id"]: row for row in new})
            decisions += buffer.add(scored_groups(new, new_scores, attempt))
        if not sampled:  # carried-over groups alone fed this step: its sampling tables are empty
            persist(run_dir, "rollouts", step, [], run_id)
            persist(run_dir, "scores", step, [], run_id)
        with watch("filter"):
            selected, advantages, filter_metrics = filter_task(buffer, decisions, adv_config, rows_by_sample,
                                                               step=step, **common)
            keep = {sid for group in buffer.pending for sid in group.sample_ids}
            for sample_id in [sid for sid in rows_by_sample if sid not in keep]:
                del rows_by_sample[sample_id]
        batches, batch_rows = [], []
        if selected:
            with watch("pack"):
                batches, batch_rows = pack_task(selected, advantages, rl.optim.token_budget, run_id, step)
        persist(run_dir, "batches", step, batch_rows, run_id)
        with watch("train"):
            step_loss = with_reference(loss_fn, ref_model, batches, config)
            metrics = train_task(model, optimizer, scheduler, batches, step_loss, normaliser=normaliser,
                                 constant=constant, max_grad_norm=rl.optim.max_grad_norm,
                                 autocast=config.model.bf16_autocast, epochs=rl.ppo_epochs, step=step,
                                 temperature=rl.sampling.temperature)
        version = step * rl.ppo_epochs
        # eval and the step's row come before the checkpoint: a checkpoint marks the step done
        step_eval = {}
        if due(step, rl.eval_every, rl.steps):
            with watch("eval"):
                step_eval = eval_metrics = evaluate(step)
        checkpoint_path = None
        # servers only take weights from disk: an HTTP run checkpoints every step
        if due(step, rl.checkpoint_every, rl.steps) or config.engine.type == "http":
            # the step's row before the checkpoint, which marks the step done; and every queued
            # table write on disk first, so that a resume never starts past a missing table
            persist(run_dir, "train_steps", step, [train_step_row(run_id, step, "rl", metrics, watch.seconds)],
                    run_id)
            with watch("checkpoint"):
                drain_writes()
                row = checkpoint_task(
                    run_dir=run_dir, run_id=run_id, step=step, policy_version=version, model=model,
                    tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                    data_state={"prompts": prompts.state_dict(), "buffer": buffer.state_dict()},
                    metrics=metrics, tracker=tracker, model_name=model_name)
                persist(run_dir, "checkpoints", step, [row], run_id)
                checkpoint_path = last_path = row["path"]
            if step_eval and step_eval["eval/accuracy"] > best and row["mlflow_model_version"]:
                best = step_eval["eval/accuracy"]
                tracker.set_alias(model_name, "best", row["mlflow_model_version"])
        if config.engine.type == "vllm" or checkpoint_path:
            with watch("sync"):
                shared = config.engine.type != "http"  # in-process engines read the trainer's tensors
                sync_rows = sync_task(engines, None if shared else checkpoint_path, version, run_id=run_id,
                                      step=step, retries=config.engine.retries)
                persist(run_dir, "syncs", step, sync_rows, run_id)
                raise_failed(sync_rows)
        # the step's row, with checkpoint and sync seconds (a checkpoint step writes it twice)
        persist(run_dir, "train_steps", step, [train_step_row(run_id, step, "rl", metrics, watch.seconds)], run_id)
        tracker.log_metrics(_step_metrics(metrics, filter_metrics, sampled, scored, watch.seconds) | step_eval,
                            step=step)
        bar.update(1)
        bar.set_postfix(reward=f"{filter_metrics.get('rollout/reward_mean', 0):.2f}",
                        **({"acc": f"{step_eval['eval/accuracy']:.2f}"} if step_eval else {}))
    bar.close()
    if last_path is None:
        last = latest_checkpoint(run_dir)
        last_path = str(last) if last else None
    return {"checkpoint": last_path, "eval": eval_metrics, "steps": rl.steps}


def with_reference(loss_fn, ref_model, batches: list, config: RunConfig):
    """loss_fn with the reference policy's log-probs of `batches` bound (KL penalty), computed once
    per batch; loss_fn itself without a reference."""
    if ref_model is None or not batches:
        return loss_fn
    from training.kl import reference_logprobs
    from training.rl_loss import bind_batch_inputs

    ref = reference_logprobs(ref_model, batches, temperature=config.rl.sampling.temperature,
                             autocast=config.model.bf16_autocast)
    return bind_batch_inputs(loss_fn, batches, ref_logprobs=ref)


def overlong_penalty_fn(rl):
    """DAPO's soft overlong penalty as a function of the completion length, or None when off."""
    if rl.overlong_buffer == 0:
        return None
    import functools

    from training.advantages import overlong_penalty

    return functools.partial(overlong_penalty, max_length=rl.sampling.max_new_tokens,
                             buffer_length=rl.overlong_buffer, factor=rl.overlong_penalty)


def _local_engine(model, config: RunConfig):
    from engines.torch_engine import TorchEngine

    return TorchEngine(model, dtype=engine_dtype(model, config.model.bf16_autocast))


def _step_metrics(train: dict, filt: dict, rollouts: list[dict], scores: list[dict],
                  seconds: dict[str, float]) -> dict[str, float]:
    out = {f"train/{k}": float(v) for k, v in train.items() if isinstance(v, int | float)
           and k not in ("seconds", "tokens_per_second")}
    out |= {k: float(v) for k, v in filt.items()}
    if rollouts:
        lengths = [r["n_completion_tokens"] for r in rollouts]
        out["rollout/completion_length_mean"] = sum(lengths) / len(lengths)
        out["rollout/reward_mean_all"] = sum(s["reward"] for s in scores) / len(scores)
        out["rollout/reward_errors"] = float(sum(s["error"] is not None for s in scores))
    out["perf/tokens_per_second"] = float(train.get("tokens_per_second", 0.0))
    out |= {f"perf/seconds_{k}": v for k, v in seconds.items()}
    out["perf/seconds_total"] = sum(seconds.values())
    return out
