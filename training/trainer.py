"""One trainer interface: an optimizer step over a step's micro-batches, in one process or over
data-parallel ranks (training/dist_trainer.py), the same call for both.

    options = TrainOptions(step=StepOptions(normaliser="token"), max_grad_norm=1.0, epochs=1)
    trainer = LocalTrainer(model, optimizer, scheduler, options, reference=None)
    inputs = trainer.reference_inputs(batches)         # per micro-batch loss inputs (KL reference)
    metrics = trainer.step(batches, loss_fn, inputs)   # forward/backward + optimizer step
    trainer.finish()                                   # end of the phase

`budget` sizes the micro-batches of a step so that each process gets work; the rest of the
pipeline (pack, SFT, RL setup) never asks how many processes train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from rlpipe.training.batch import PackedBatch
from rlpipe.training.loss_inputs import capture_logprobs, with_batch_inputs
from rlpipe.training.step import StepOptions, forward_backward, optim_step

Logprobs = dict[tuple[str, ...], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """How a phase trains each step (built once per phase from its config)."""

    step: StepOptions = field(default_factory=lambda: StepOptions(entropy=True))
    """How each step's loss and gradients are computed (normaliser, autocast, temperature,
    entropy: training/step.py); a phase logs the policy's entropy unless told otherwise."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping (None or <= 0: measure only)."""
    epochs: int = 1
    """Optimizer steps over the same micro-batches (1 = on-policy; PPO epochs)."""


class Trainer(Protocol):
    """What a phase trains with (`LocalTrainer`, training.dist_trainer.ParallelTrainer).

    model: whole weights (engines, evals and checkpoints read it); optimizer: checkpoints save
    its whole state; scheduler: the lr schedule."""

    model: Any
    optimizer: Any
    scheduler: Any
    options: TrainOptions

    def budget(self, sizes: list[int], token_budget: int) -> int:
        """The micro-batch token budget of a step whose packing units have `sizes`."""

    def reference_inputs(self, batches: list[PackedBatch]) -> dict[str, list[torch.Tensor]]:
        """Per micro-batch loss inputs computed once per step (the KL reference's log-probs)."""

    def step(self, batches: list[PackedBatch], loss_fn, inputs: dict[str, list[torch.Tensor]],
             logprobs: Logprobs | None = None) -> dict[str, float]:
        """One optimizer step; `logprobs` is filled with the trainer's per-token log-probs."""

    def finish(self) -> None:
        """The phase is over."""


@dataclass
class LocalTrainer:
    """The trainer of one process. reference: the KL penalty's frozen policy, or None."""

    model: Any
    optimizer: Any
    scheduler: Any
    options: TrainOptions
    reference: Any = None

    def budget(self, sizes: list[int], token_budget: int) -> int:
        """One process takes every micro-batch: the configured budget."""
        return token_budget

    def reference_inputs(self, batches: list[PackedBatch]) -> dict[str, list[torch.Tensor]]:
        """The reference's log-probs of `batches` when there is a KL penalty (training/kl.py), else {}."""
        if self.reference is None or not batches:
            return {}
        from rlpipe.training.kl import reference_logprobs

        return {"ref_logprobs": reference_logprobs(self.reference, batches, temperature=self.options.step.temperature,
                                                   autocast=self.options.step.autocast)}

    def step(self, batches: list[PackedBatch], loss_fn, inputs: dict[str, list[torch.Tensor]],
             logprobs: Logprobs | None = None) -> dict[str, float]:
        """forward_backward over `batches` with `inputs` bound, then clip, step and schedule."""
        loss_fn = with_batch_inputs(loss_fn, batches, inputs)
        if logprobs is not None:
            loss_fn = capture_logprobs(loss_fn, logprobs)
        metrics = dict(forward_backward(self.model, batches, loss_fn, self.options.step))
        metrics.update(optim_step(self.model, self.optimizer, self.scheduler, self.options.max_grad_norm))
        return metrics

    def finish(self) -> None:
        """Nothing to release in one process."""
