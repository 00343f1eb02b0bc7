"""Building the trainer on every rank of a data-parallel run, and what ranks > 0 do.

Rank 0 runs the flow. Where a phase builds its trainer it calls `make_trainer`, which sends the
other ranks a `TrainerSpec` (what model, optimizer and loss to build) and then runs the same
collective set-up on every rank: rank 0's weights broadcast, the model wrapped (DDP or FSDP2),
the optimizer built after wrapping, a resumed optimizer state broadcast. Ranks > 0 run
`follow_ranks`: build a trainer per spec, train the steps rank 0 sends, until the run ends.

Not a stage: nothing is persisted here (the flows on rank 0 write every table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from rlpipe.tasks.setup import Placement, make_optimizer, placement, prepare_model
from rlpipe.training.dist_state import broadcast_weights, load_full_optimizer_state
from rlpipe.training.dist_trainer import ParallelTrainer, follow
from rlpipe.training.distributed import GatheredOptimizer, data_parallel
from rlpipe.training.policy_loss import PolicyLoss, phase_loss_fn
from rlpipe.training.trainer import LocalTrainer, Trainer, TrainOptions


@dataclass(frozen=True)
class TrainerPlan:
    """What a phase trains: its optimizer section and steps, its loss and train options."""

    optim: Any
    total_steps: int
    loss: PolicyLoss | None
    """None (NLL) for pretrain/SFT, the policy loss for RL (training/policy_loss.py
    `phase_loss_fn` builds it on each rank)."""
    options: TrainOptions
    reference: bool = False
    """Keep a frozen copy of the starting weights as the KL penalty's reference."""
    engines: Literal["none", "eval", "rollout"] = "none"
    """The engines tasks/build.py opens: none; eval: an in-process engine for evals; rollout:
    config.engine's engines, and an eval engine that reads the trainer's weights."""
    single_process: bool = False
    """Train in this process whatever train.parallel says (replaying a data-parallel step)."""


@dataclass(frozen=True)
class TrainerSpec:
    """What every rank needs to build the same trainer (pickled from rank 0 to the others)."""

    model_class: type
    model_config: Any
    dtype: torch.dtype
    placement: Placement
    """Device, activation checkpointing, compilation and the LoRA adapters every rank injects
    before rank 0's weights (adapters included) are broadcast."""
    parallel: str
    optim: Any
    total_steps: int
    loss: PolicyLoss | None
    """None (NLL) for pretrain/SFT, the policy loss for RL (training/policy_loss.py
    `phase_loss_fn` builds it on each rank)."""
    reference: bool = False
    """A KL reference (rl.loss.kl_coef > 0): every rank holds one, loaded with rank 0's, and scores its
    own micro-batches (training/dist_reference.py)."""


def spec_for(config, model, optim, total_steps: int, loss: PolicyLoss | None, reference: bool = False) -> TrainerSpec:
    """The TrainerSpec of `model` (placed, adapters injected) under `config`."""
    return TrainerSpec(model_class=type(model), model_config=model.config, dtype=next(model.parameters()).dtype,
                       placement=placement(config), parallel=config.train.parallel, optim=optim,
                       total_steps=total_steps, loss=loss, reference=reference)


def make_trainer(config, model, plan: TrainerPlan, resume_from: Path | None, ref_model=None) -> Trainer:
    """Rank 0: the trainer of `model` (weights already placed, a resumed checkpoint's already
    loaded) for what `plan` trains: a LocalTrainer, or a ParallelTrainer over every rank when
    train.parallel is set (and `plan.single_process` is not: replay).
    ref_model: the KL reference, which every rank then holds (sharded in place under FSDP2)."""
    optim, total_steps, options = plan.optim, plan.total_steps, plan.options
    from rlpipe.training.checkpoint_io import read_optimizer_state

    state = read_optimizer_state(resume_from) if resume_from is not None else None
    if plan.single_process or config.train.parallel == "none":
        optimizer, scheduler = make_optimizer(model, optim, total_steps)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        return LocalTrainer(model, optimizer, scheduler, options, reference=ref_model)
    if not dist.is_initialized():
        raise ValueError(f"train.parallel = {config.train.parallel!r} needs a distributed launch: "
                         "`rlpipe run CONFIG --nproc-per-node N` or torchrun")
    spec = spec_for(config, model, optim, total_steps, plan.loss, reference=ref_model is not None)
    dist.broadcast_object_list([("begin", spec)], src=0)
    dp, optimizer, scheduler = _collective_setup(spec, model, state, ref_model)
    return ParallelTrainer(dp, GatheredOptimizer(dp, optimizer), scheduler, options)


def _collective_setup(spec: TrainerSpec, model, state: dict | None, ref_model=None):
    """Every rank: rank 0's weights everywhere, wrap, optimizer after wrapping, resumed state;
    rank 0's KL reference (`ref_model` there, a fresh model on the others) on every rank."""
    from rlpipe.models.device import resolve_device

    broadcast_weights(model)
    device = resolve_device(spec.placement.device)
    dp = data_parallel(model, spec.parallel, device)
    if spec.reference:
        from rlpipe.training.dist_reference import place_reference

        ref = ref_model if ref_model is not None else _fresh_model(spec)
        broadcast_weights(ref)
        dp.reference = place_reference(ref, spec.parallel, device)
    optimizer, scheduler = make_optimizer(model, spec.optim, spec.total_steps)
    resumed = [state is not None]
    dist.broadcast_object_list(resumed, src=0)
    if resumed[0]:
        load_full_optimizer_state(optimizer, state["optimizer"] if state else None)
        schedule = [state["scheduler"] if state else None]
        dist.broadcast_object_list(schedule, src=0)
        scheduler.load_state_dict(schedule[0])
    return dp, optimizer, scheduler


def follow_ranks() -> int:
    """Ranks > 0: build each phase's trainer as rank 0 asks and train its steps, until rank 0
    ends the run. Returns the optimizer steps taken."""
    steps = 0
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0][0] == "end":
            return steps
        if message[0][0] != "begin":
            raise RuntimeError(f"rank {dist.get_rank()}: expected a trainer spec from rank 0, got {message[0][0]!r}")
        spec: TrainerSpec = message[0][1]
        model = _fresh_model(spec)
        dp, optimizer, scheduler = _collective_setup(spec, model, None)
        steps += follow(dp, optimizer, scheduler, phase_loss_fn(spec.loss))


def end_run() -> None:
    """Rank 0, after the flow: the other ranks' `follow_ranks` returns."""
    dist.broadcast_object_list([("end",)], src=0)


def _fresh_model(spec: TrainerSpec):
    """A model of rank 0's class and config, placed like rank 0's with the same adapters (its
    weights come from rank 0)."""
    model = spec.model_class(spec.model_config)
    model.to(dtype=spec.dtype)
    model.train()
    return prepare_model(model, dataclasses.replace(spec.placement,
                                                    weights_dtype=str(spec.dtype).removeprefix("torch.")))
