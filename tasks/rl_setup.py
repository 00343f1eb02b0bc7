"""Building an RL run's state once, before its first step: model, optimizer, loss, engines, the
rollout source, and what a resume restores and repairs.

Not a stage (nothing is persisted but the repairs): flows/rl.py calls `open_rl` and keeps the
result for the whole run; `close` releases the engines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment, Example
from rlpipe.envs.timeout import with_reward_timeout
from rlpipe.rollouts.options import rollout_options
from rlpipe.rollouts.source import RolloutSource
from rlpipe.tasks.checkpoint import repair_checkpoint_row
from rlpipe.tasks.evaluate import eval_step
from rlpipe.tasks.ranks import make_trainer
from rlpipe.tasks.rollout_stages import RunStages
from rlpipe.tasks.setup import (
    engine_dtype,
    make_env,
    make_model_and_tokenizer,
    max_context,
    place_model,
    stop_token_ids,
)
from rlpipe.tasks.sync import sync_task
from rlpipe.training.advantages import overlong_penalty
from rlpipe.training.checkpoint import latest_checkpoint, load_checkpoint
from rlpipe.training.kl import frozen_copy
from rlpipe.training.lora import lora_from_config
from rlpipe.training.oversampling import GroupBuffer
from rlpipe.training.rl_loss import loss_normaliser


@dataclass
class RLRun:
    """The trainer's state of one RL run (local to the flow, passed explicitly to stages)."""

    model: Any
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    loss_fn: Any
    env: Environment
    engines: list[Engine]
    eval_engine: Engine
    eval_examples: list[Example]
    source: RolloutSource
    start_step: int
    stop_token_ids: tuple[int, ...]
    max_context: int
    max_new_tokens: int
    train_options: dict[str, Any] = field(default_factory=dict)
    closing: list[Engine] = field(default_factory=list)
    ref_model: Any = None
    """The frozen starting policy of the KL penalty (rl.kl_coef > 0), else None."""
    ref_options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    """Data-parallel ranks training each step (pack sizes micro-batches so each gets work)."""
    finish: Any = None
    """Called once the loop's last step is done: data-parallel ranks stop following (tasks/ranks.py)."""

    def batch_inputs(self, batches: list) -> dict[str, list]:
        """The per micro-batch loss inputs of one step: the reference's log-probs of `batches`
        when there is a KL penalty (computed once per batch, training/kl.py), else {}; under
        train.parallel each rank computes its own share's instead (training/dist_reference.py)."""
        if self.ref_model is None or not batches or self.world_size > 1:
            return {}  # data-parallel: every rank scores its own share (training/dist_reference.py)
        from rlpipe.training.kl import reference_logprobs

        return {"ref_logprobs": reference_logprobs(self.ref_model, batches, **self.ref_options)}

    def evaluate(self, step: int, *, run_dir: Path, run_id: str) -> dict[str, float]:
        """Greedy held-out accuracy of the trainer's weights at `step` (the `evals` table)."""
        return eval_step(self.eval_engine, self.tokenizer, self.env, self.eval_examples, run_dir=run_dir,
                         run_id=run_id, step=step, max_new_tokens=self.max_new_tokens,
                         stop_token_ids=self.stop_token_ids, max_context=self.max_context)

    @property
    def needs_checkpoint_to_sync(self) -> bool:
        return any(e.syncs_from_checkpoint for e in self.engines)

    def close(self) -> None:
        for engine in self.closing:
            engine.close()


def make_engines(config, model) -> list[Engine]:
    """The rollout engines of `config.engine`; in-process async RL samples from a weights snapshot."""
    if config.engine.type == "http":
        from rlpipe.engines.http import engines_from_config

        # a tied model's checkpoints name their lm_head for vLLM servers (tasks/checkpoint.py)
        return engines_from_config(config.engine)
    dtype = engine_dtype(model, config.model.bf16_autocast)
    if config.engine.type == "vllm":
        from rlpipe.engines.vllm_engine import VllmEngine  # optional extra

        # the sampling dtype of the torch engine: else vLLM takes the fp32 master weights' dtype.
        # Async RL keeps vLLM awake: waking up pushes the trainer's tensors, and the producer
        # thread would read them in the middle of an optimizer step.
        return [VllmEngine(model, dtype=str(dtype).removeprefix("torch."),
                           gpu_memory_utilization=config.engine.gpu_memory_utilization,
                           max_model_len=config.engine.max_model_len or None,
                           enforce_eager=not config.engine.cuda_graphs,
                           sleep_between_calls=config.rl.max_off_policy_steps == 0)]
    if config.rl.max_off_policy_steps > 0:
        from rlpipe.engines.snapshot import SnapshotEngine

        return [SnapshotEngine(model, dtype=dtype)]
    from rlpipe.engines.torch_engine import TorchEngine

    return [TorchEngine(model, dtype=dtype, cuda_graphs=config.engine.cuda_graphs)]


def loss_for(rl):
    """The policy loss; async RL (k >= 1) gets truncated importance weights by default, the
    sequence mask of rl.off_policy_sequence_mask, and the mismatch metrics."""
    from rlpipe.training.off_policy import with_sequence_mask
    from rlpipe.training.rl_loss import build_rl_loss

    tis_cap = rl.tis_cap
    if rl.max_off_policy_steps > 0 and tis_cap == 0 and rl.loss == "reinforce":
        tis_cap = rl.off_policy_tis_cap
    loss_fn = build_rl_loss(rl.loss, epsilon_low=rl.epsilon_low, epsilon_high=rl.epsilon_high, tis_cap=tis_cap,
                            cispo_cap=rl.cispo_cap, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator)
    if rl.max_off_policy_steps > 0 or rl.off_policy_sequence_mask > 0:
        loss_fn = with_sequence_mask(loss_fn, rl.off_policy_sequence_mask)
    return loss_fn


def overlong_penalty_fn(rl):
    """DAPO's soft overlong penalty as a function of the completion length, or None when off."""
    if rl.overlong_buffer == 0:
        return None
    return functools.partial(overlong_penalty, max_length=rl.sampling.max_new_tokens,
                             buffer_length=rl.overlong_buffer, factor=rl.overlong_penalty)


def open_rl(config, run_dir: Path, run_id: str, start_checkpoint: str | None, model_name: str) -> RLRun:
    """Build (or restore, from the run's newest checkpoint) everything the RL loop needs."""
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.envs.prompts import PromptSource

    rl = config.rl
    env = with_reward_timeout(make_env(config.task.env, config.task.options, config.task.reward_models,
                                       config.task.env_reward_weight), config.task.reward_timeout_s)
    model, tokenizer = make_model_and_tokenizer(
        config.model.preset, start_checkpoint or config.model.path, config.model.overrides, config.seed)
    place_model(model, config.device, config.model.weights_dtype, config.train.activation_checkpointing,
                config.train.compile)
    model = lora_from_config(model, config.model.lora)  # adapters only train (training/lora.py)
    ref_model = frozen_copy(model) if rl.kl_coef > 0 else None  # the start, before a resume loads
    prompts = PromptSource(env.examples("train", seed=config.seed), seed=config.seed)
    options = rollout_options(rl)
    buffer = GroupBuffer(options.buffer)
    start_step, resume_from = 0, latest_checkpoint(run_dir)
    if resume_from is not None:
        loaded = load_checkpoint(resume_from, model=model)  # weights, data state, RNG
        start_step = int(loaded.metadata["step"])
        prompts.load_state_dict(loaded.data_state["prompts"])
        buffer.load_state_dict(loaded.data_state["buffer"])
        repair_checkpoint_row(run_dir, run_id, start_step, resume_from, model_name)
    # the optimizer after any data-parallel wrapping; `model` then has whole weights (rank 0's view)
    trainer = make_trainer(config, model, rl.optim, rl.steps * rl.ppo_epochs, ("rl", rl), resume_from,
                           ref_model=ref_model)
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    engines = make_engines(config, model)
    version = start_step * rl.ppo_epochs
    # servers restart from a resumed checkpoint (its syncs rows are repaired), or take the
    # pipeline's SFT result, which no server was started from
    sync_from = resume_from if resume_from is not None else start_checkpoint
    if sync_from:
        sync_task(engines, str(sync_from), version, run_dir=run_dir, run_id=run_id, step=start_step,
                  retries=config.engine.retries, only_missing=True)
    # evals read the trainer's weights in-process: other engines may lag a sync behind
    eval_engine = engines[0] if engines[0].shares_weights else \
        TorchEngine(model, dtype=engine_dtype(model, config.model.bf16_autocast))
    stops, context = stop_token_ids(tokenizer), max_context(model)
    sampling = SamplingParams(n=rl.group_size, temperature=rl.sampling.temperature, top_p=rl.sampling.top_p,
                              top_k=rl.sampling.top_k, max_new_tokens=rl.sampling.max_new_tokens,
                              stop_token_ids=stops)
    stages = RunStages(engines=engines, tokenizer=tokenizer, env=env, sampling=sampling, seed=config.seed,
                       max_context=context, max_error_fraction=rl.max_reward_error_fraction,
                       run_dir=run_dir, run_id=run_id, length_penalty=overlong_penalty_fn(rl))
    source = RolloutSource(options, prompts, buffer, stages, start_step=start_step, published_version=version)
    # gspo normalises per sequence, dr_grpo by a constant (training/rl_loss.py, loss_normaliser)
    normaliser, constant = loss_normaliser(rl.loss, rl.optim.normaliser, rl.prompts_per_step * rl.group_size,
                                           rl.sampling.max_new_tokens)
    return RLRun(model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                 loss_fn=loss_for(rl), env=env, engines=engines, eval_engine=eval_engine,
                 eval_examples=list(env.examples("eval", seed=config.seed))[: config.task.eval_examples],
                 source=source, start_step=start_step, stop_token_ids=stops, max_context=context,
                 max_new_tokens=rl.sampling.max_new_tokens,
                 train_options=dict(normaliser=normaliser, constant=constant, max_grad_norm=rl.optim.max_grad_norm,
                                    autocast=config.model.bf16_autocast, epochs=rl.ppo_epochs,
                                    temperature=rl.sampling.temperature, parallel=trainer.dp),
                 closing=list(dict.fromkeys([*engines, eval_engine])), ref_model=ref_model,
                 ref_options=dict(temperature=rl.sampling.temperature, autocast=config.model.bf16_autocast),
                 finish=trainer.finish, world_size=trainer.dp.world_size if trainer.dp else 1)
