"""The one builder of a phase's trainer state: model, tokenizer, LoRA, the KL reference,
optimizer and scheduler (one process or data-parallel, tasks/ranks.py), the loss, and the engines,
from a config and a starting point.

    built = build(config, TrainerPlan(...), start_point(config, run_dir, start_checkpoint))
    built.trainer.step(...)      # training/trainer.py; built.engines sample, built.eval_engine evals

Pretrain/SFT (tasks/supervised_setup.py), RL (tasks/rl_setup.py) and replay (tasks/replay_step.py) call
it; every data-parallel rank builds the same model through `prepare_model` (tasks/setup.py) and
the same optimizer in `make_trainer`. Not a stage: nothing is persisted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.core.config import options_from
from rlpipe.engines.base import Engine
from rlpipe.tasks.ranks import TrainerPlan, make_trainer
from rlpipe.tasks.setup import engine_dtype, make_model_and_tokenizer, placement, prepare_model
from rlpipe.training.checkpoint_files import resume_checkpoint
from rlpipe.training.checkpoint_io import load_checkpoint
from rlpipe.training.policy_loss import phase_loss_fn
from rlpipe.training.step import StepOptions
from rlpipe.training.trainer import Trainer, TrainOptions


@dataclass(frozen=True)
class StartPoint:
    """Where a phase's weights come from."""

    weights: str = ""
    """A model folder to start from (a start checkpoint or model.path; '' = the seeded preset)."""
    resume: Path | None = None
    """A checkpoint to continue: its weights, optimizer and scheduler state, data state and step."""
    restore_rng: bool = True
    """Set the RNGs to the resumed checkpoint's (a run resuming; not a replay)."""


@dataclass
class Built:
    """A phase's trainer state."""

    model: Any
    """Whole weights (rank 0's view under data parallelism): engines, evals, checkpoints read it."""
    tokenizer: Any
    trainer: Trainer
    loss_fn: Any
    """The phase's loss (`TrainerPlan.loss` through training/policy_loss.py `phase_loss_fn`, as every rank builds it)."""
    start_step: int = 0
    data_state: dict = field(default_factory=dict)
    """The resumed checkpoint's data state ({} when starting)."""
    engines: list[Engine] = field(default_factory=list)
    eval_engine: Engine | None = None

    @property
    def closing(self) -> list[Engine]:
        """Every engine once, to close at the end of the phase."""
        return list(dict.fromkeys([*self.engines, *([self.eval_engine] if self.eval_engine else [])]))


def start_point(config, run_dir: Path, start_checkpoint: str | None) -> StartPoint:
    """A run phase's start: `start_checkpoint` or model.path, resumed from the run's newest whole
    checkpoint (a damaged newer one is moved aside and said so on stderr: training/checkpoint_io.py)."""
    resume, notes = resume_checkpoint(run_dir)
    for note in notes:  # not print: in a flow, Prefect's log_prints makes it an INFO log, not shown
        sys.stderr.write(f"rlpipe: {note}\n")
    return StartPoint(weights=start_checkpoint or config.model.path, resume=resume)


def build(config, plan: TrainerPlan, start: StartPoint) -> Built:
    """Model and tokenizer at `start`, placed with LoRA, the KL reference (the starting weights,
    before a resume loads), a resumed checkpoint's weights, the trainer (optimizer after any
    data-parallel wrapping) and the engines of `plan`."""
    model, tokenizer = make_model_and_tokenizer(config.model.preset, start.weights, config.model.overrides,
                                                config.seed)
    model = prepare_model(model, placement(config))
    reference = None
    if plan.reference:
        from rlpipe.training.kl import frozen_copy

        reference = frozen_copy(model)
    start_step, data_state = 0, {}
    if start.resume is not None:
        loaded = load_checkpoint(start.resume, model=model, restore_rng=start.restore_rng)
        start_step, data_state = int(loaded.metadata["step"]), loaded.data_state
    trainer = make_trainer(config, model, plan, start.resume, ref_model=reference)
    model = trainer.model  # under data parallelism: rank 0's whole-weight view
    engines, eval_engine = open_engines(config, model, plan.engines)
    return Built(model=model, tokenizer=tokenizer, trainer=trainer, loss_fn=phase_loss_fn(plan.loss),
                 start_step=start_step, data_state=data_state, engines=engines, eval_engine=eval_engine)


def open_engines(config, model, which: str) -> tuple[list[Engine], Engine | None]:
    """(rollout engines, eval engine) of `which` (TrainerPlan.engines). Evals read the trainer's
    weights in-process: other engines may lag a sync behind."""
    if which == "none":
        return [], None
    engines = make_engines(config, model) if which == "rollout" else []
    if engines and engines[0].shares_weights:
        return engines, engines[0]
    from rlpipe.engines.torch_engine import TorchEngine

    return engines, TorchEngine(model, dtype=engine_dtype(model, config.model.bf16_autocast))


def engine_type(config, model) -> str:
    """`engine.type` with "auto" decided: "vllm" when `model` is on CUDA, vLLM is importable and
    a single process trains (in-process vLLM is refused under data parallelism), else "torch"."""
    if config.engine.type != "auto":
        return config.engine.type
    import importlib.util

    import torch

    on_cuda = next(model.parameters()).device.type == "cuda"
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    single = ranks == 1 and config.train.parallel == "none"
    return "vllm" if on_cuda and single and importlib.util.find_spec("vllm") is not None else "torch"


def make_engines(config, model) -> list[Engine]:
    """The rollout engines of `config.engine` (`engine_type`); in-process async RL samples from a
    weights snapshot."""
    kind = engine_type(config, model)
    if kind == "http":
        from rlpipe.engines.http import engines_from_config

        # a tied model's checkpoints name their lm_head for vLLM servers (tasks/checkpoint.py)
        return engines_from_config(config.engine)
    dtype = engine_dtype(model, config.model.bf16_autocast)
    if config.rl.off_policy.partial_rollouts and kind != "torch":
        raise ValueError(f"rl.off_policy.partial_rollouts needs the in-process torch engine; engine.type = 'auto' chose "
                         f"{kind!r} here: set engine.type = 'torch'")
    if kind == "vllm":
        from rlpipe.engines.vllm_engine import VllmEngine  # optional extra

        # the sampling dtype of the torch engine: else vLLM takes the fp32 master weights' dtype.
        # Async RL keeps vLLM awake: waking up pushes the trainer's tensors, and the producer
        # thread would read them in the middle of an optimizer step.
        return [VllmEngine(model, dtype=str(dtype).removeprefix("torch."),
                           gpu_memory_utilization=config.engine.gpu_memory_utilization,
                           max_model_len=config.engine.max_model_len or None,
                           enforce_eager=not config.engine.cuda_graphs,
                           sleep_between_calls=config.rl.off_policy.max_steps == 0)]
    if config.rl.off_policy.max_steps > 0 and config.engine.producer == "process":
        from rlpipe.engines.process_engine import ProcessEngine

        return [ProcessEngine(model, dtype=dtype, threads=config.threads)]
    if config.rl.off_policy.max_steps > 0:
        from rlpipe.engines.snapshot import SnapshotEngine

        return [SnapshotEngine(model, dtype=dtype, partial=config.rl.off_policy.partial_rollouts)]
    from rlpipe.engines.torch_engine import TorchEngine

    return [TorchEngine(model, dtype=dtype, cuda_graphs=config.engine.cuda_graphs)]


def rl_plan(config) -> TrainerPlan:
    """The RL phase's trainer: rl.optim over steps × ppo_epochs optimizer steps, the policy loss,
    the KL reference when rl.loss.kl_coef > 0, rollout engines. gspo normalises per sequence, dr_grpo
    by a constant (training/rl_loss.py, LOSSES)."""
    rl = config.rl
    normaliser, constant = rl.loss_normaliser()
    step = StepOptions(normaliser=normaliser, constant=constant, autocast=config.model.bf16_autocast,
                       temperature=rl.sampling.temperature, entropy=True, head=config.train.logprobs)
    options = options_from(TrainOptions, rl.optim, step=step, epochs=rl.loss.ppo_epochs)
    return TrainerPlan(optim=rl.optim, total_steps=rl.steps * rl.loss.ppo_epochs, loss=rl.policy_loss(), options=options,
                       reference=rl.loss.kl_coef > 0, engines="rollout")


def supervised_plan(config, phase: str) -> TrainerPlan:
    """The pretrain or SFT phase's trainer: its optim section, next-token NLL, an eval engine."""
    section = getattr(config, phase)
    step = StepOptions(normaliser=section.optim.normaliser or "token", autocast=config.model.bf16_autocast, entropy=True,
                       head=config.train.logprobs)
    options = options_from(TrainOptions, section.optim, step=step)
    return TrainerPlan(optim=section.optim, total_steps=section.steps, loss=None, options=options,
                       engines="eval")
