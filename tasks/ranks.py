"""Building the trainer on every rank of a data-parallel run, and what ranks > 0 do.

Rank 0 runs the flow. Where a phase builds its trainer it calls `make_trainer`, which sends the
other ranks a `TrainerSpec` (what model, optimizer and loss to build) and then runs the same
collective set-up on every rank: rank 0's weights broadcast, the model wrapped (DDP or FSDP2),
the optimizer built after wrapping, a resumed optimizer state broadcast. Ranks > 0 run
`follow_ranks`: build a trainer per spec, train the steps rank 0 sends, until the run ends.

Not a stage: nothing is persisted here (the flows on rank 0 write every table).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rlpipe.tasks.setup import make_optimizer, place_model
from rlpipe.training.dist_state import broadcast_weights, load_full_optimizer_state
from rlpipe.training.distributed import (
    DataParallel,
    GatheredOptimizer,
    data_parallel,
    follow,
    stop_followers,
)


@dataclass(frozen=True)
class TrainerSpec:
    """What every rank needs to build the same trainer (pickled from rank 0 to the others)."""

    model_class: type
    model_config: Any
    dtype: torch.dtype
    device: str
    activation_checkpointing: bool
    parallel: str
    optim: Any
    total_steps: int
    loss: tuple
    """("nll",) for pretrain/SFT, ("rl", RLConfig) for RL (each rank builds loss_for(rl))."""
    compile: bool = False
    """train.compile: each rank compiles its decoder layers (models/compile.py)."""
    lora: Any = None
    """The run's `model.lora` section: each rank injects the same adapters before rank 0's
    weights (adapters included) are broadcast."""
    reference: bool = False
    """A KL reference (rl.kl_coef > 0): every rank holds one, loaded with rank 0's, and scores its
    own micro-batches (training/dist_reference.py)."""


@dataclass
class Trainer:
    """model: whole weights (rank 0's engines, evals, checkpoints read it); optimizer: checkpoints
    save its whole state; dp: pass to the train stage (None in a single process)."""

    model: Any
    optimizer: Any
    scheduler: Any
    dp: DataParallel | None = None

    def finish(self) -> None:
        """End of the phase on rank 0: the other ranks stop following (they wait for the next)."""
        if self.dp is not None:
            stop_followers(self.dp)


def spec_for(config, model, optim, total_steps: int, loss: tuple, reference: bool = False) -> TrainerSpec:
    return TrainerSpec(model_class=type(model), model_config=model.config, dtype=next(model.parameters()).dtype,
                       device=config.device, activation_checkpointing=config.train.activation_checkpointing,
                       parallel=config.train.parallel, optim=optim, total_steps=total_steps, loss=loss,
                       lora=config.model.lora, compile=config.train.compile, reference=reference)


def make_trainer(config, model, optim, total_steps: int, loss: tuple, resume_from: Path | None,
                 ref_model=None) -> Trainer:
    """Rank 0: the optimizer and scheduler of `model` (weights already placed, a resumed
    checkpoint's already loaded), data-parallel over every rank when train.parallel is set.
    ref_model: the KL reference, which every rank then holds (sharded in place under FSDP2)."""
    from rlpipe.training.checkpoint import read_optimizer_state

    state = read_optimizer_state(resume_from) if resume_from is not None else None
    if config.train.parallel == "none":
        optimizer, scheduler = make_optimizer(model, optim, total_steps)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        return Trainer(model, optimizer, scheduler)
    if not dist.is_initialized():
        raise ValueError(f"train.parallel = {config.train.parallel!r} needs a distributed launch: "
                         "`rlpipe run CONFIG --nproc-per-node N` or torchrun")
    spec = spec_for(config, model, optim, total_steps, loss, reference=ref_model is not None)
    dist.broadcast_object_list([("begin", spec)], src=0)
    dp, optimizer, scheduler = _collective_setup(spec, model, state, ref_model)
    return Trainer(dp.view, GatheredOptimizer(dp, optimizer), scheduler, dp)


def _collective_setup(spec: TrainerSpec, model, state: dict | None, ref_model=None):
    """Every rank: rank 0's weights everywhere, wrap, optimizer after wrapping, resumed state;
    rank 0's KL reference (`ref_model` there, a fresh model on the others) on every rank."""
    from rlpipe.models.device import resolve_device

    broadcast_weights(model)
    device = resolve_device(spec.device)
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
        steps += follow(dp, optimizer, scheduler, _loss(spec.loss))


def end_run() -> None:
    """Rank 0, after the flow: the other ranks' `follow_ranks` returns."""
    dist.broadcast_object_list([("end",)], src=0)


def _fresh_model(spec: TrainerSpec):
    model = spec.model_class(spec.model_config)  # weights come from rank 0
    model.to(dtype=spec.dtype)
    model.train()
    model = place_model(model, spec.device, str(spec.dtype).removeprefix("torch."), spec.activation_checkpointing,
                        spec.compile)
    if spec.lora is not None:  # the same adapters as rank 0 (open_rl / the supervised setup)
        from rlpipe.training.lora import lora_from_config

        model = lora_from_config(model, spec.lora)
    return model


def _loss(loss: tuple):
    if loss[0] == "nll":
        from rlpipe.training.losses import nll_loss

        return nll_loss
    from rlpipe.tasks.rl_setup import loss_for

    return loss_for(loss[1])
