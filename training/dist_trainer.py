"""The data-parallel trainer: rank 0 leads each optimizer step, the other ranks follow.

    trainer = ParallelTrainer(dp, GatheredOptimizer(dp, optimizer), scheduler, options)   # rank 0
    trainer.step(batches, loss_fn, inputs)          # every rank runs its share (training/distributed.py)
    follow(dp, optimizer, scheduler, loss_fn)       # ranks > 0, until rank 0's trainer.finish()

The same interface as training/trainer.LocalTrainer; tasks/ranks.py builds both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rlpipe.training.batch import PackedBatch
from rlpipe.training.dist_reference import local_reference_inputs
from rlpipe.training.dist_state import full_optimizer_state, refresh_view
from rlpipe.training.distributed import DataParallel, balanced_budget, share_of
from rlpipe.training.loss_inputs import capture_logprobs, with_batch_inputs
from rlpipe.training.step import forward_backward, optim_step
from rlpipe.training.trainer import Logprobs, TrainOptions


@dataclass
class ParallelTrainer:
    """Rank 0's trainer of a data-parallel phase. model: whole weights (`dp.view`); optimizer:
    a GatheredOptimizer (checkpoints save its whole state). A KL reference lives on every rank
    (`dp.reference`): each scores its own share."""

    dp: DataParallel
    optimizer: Any
    scheduler: Any
    options: TrainOptions

    @property
    def model(self):
        """Rank 0's whole-weight view of the trained model."""
        return self.dp.view

    def budget(self, sizes: list[int], token_budget: int) -> int:
        """Small enough micro-batches that every rank gets work (`balanced_budget`)."""
        if not sizes:
            return token_budget
        return balanced_budget(sum(sizes), max(sizes), token_budget, self.dp.world_size)

    def reference_inputs(self, batches: list[PackedBatch]) -> dict[str, list[torch.Tensor]]:
        """{}: every rank computes its own share's reference log-probs (training/dist_reference.py)."""
        return {}

    def step(self, batches: list[PackedBatch], loss_fn, inputs: dict[str, list[torch.Tensor]],
             logprobs: Logprobs | None = None) -> dict[str, float]:
        """The step on every rank (`lead_step`)."""
        return dict(lead_step(self.dp, self.optimizer, self.scheduler, batches, loss_fn, self.options,
                              batch_inputs=inputs, trainer_logprobs=logprobs))

    def finish(self) -> None:
        """End of the phase on rank 0: the other ranks stop following (they wait for the next)."""
        stop_followers(self.dp)


# Rank 0 runs the flow (tables, MLflow, engines); the other ranks only train. Each optimizer
# step, rank 0 broadcasts the step's packed micro-batches, any per-batch loss inputs it computed
# (`batch_inputs`; the KL reference's log-probs are not among them: each rank scores its own
# share, training/dist_reference.py) and the step's options; every rank then takes its share and
# runs the same step, and with `trainer_logprobs`
# sends rank 0 the per-token log-probs its loss saw. The loss function is built on each rank
# (tasks/ranks.py: a closure does not cross processes). Messages: ("train", ...),
# ("optimizer_state",), ("stop",).


def lead_step(dp: DataParallel, optimizer, scheduler, batches: list[PackedBatch], loss_fn,
              options: TrainOptions, *, batch_inputs: dict[str, list[torch.Tensor]] | None = None,
              trainer_logprobs: dict[tuple[str, ...], torch.Tensor] | None = None) -> dict[str, float]:
    """Rank 0: send a step to the other ranks, take part in it, return its metrics.

    batch_inputs: per micro-batch loss inputs in the order of `batches` (`ref_logprobs=[...]`),
    bound on every rank (training/loss_inputs.bind_batch_inputs). trainer_logprobs: filled with
    every rank's per-token trainer log-probs (CPU float32 [T]) under each micro-batch's sample_ids."""
    batch_inputs = batch_inputs or {}
    gather = trainer_logprobs is not None
    dist.broadcast_object_list([("train", batches, options, batch_inputs, gather)], src=0)
    metrics, seen = _step(dp, optimizer, scheduler, batches, loss_fn, options, batch_inputs, gather)
    if gather:
        trainer_logprobs.update(seen)
    return metrics


def stop_followers(dp: DataParallel | None = None) -> None:
    """Rank 0: let the other ranks' `follow` return."""
    dist.broadcast_object_list([("stop",)], src=0)


def follow(dp: DataParallel, optimizer, scheduler, loss_fn) -> int:
    """Ranks > 0: run what rank 0 sends until it stops them; returns the steps run."""
    steps = 0
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        kind = message[0][0]
        if kind == "stop":
            return steps
        if kind == "optimizer_state":
            full_optimizer_state(optimizer)
            continue
        if kind != "train":
            raise RuntimeError(f"rank {dp.rank}: unexpected message {kind!r} from rank 0 while training")
        _, batches, options, batch_inputs, gather = message[0]
        _step(dp, optimizer, scheduler, batches, loss_fn, options, batch_inputs, gather)
        steps += 1


def _step(dp, optimizer, scheduler, batches, loss_fn, options: TrainOptions, batch_inputs, gather):
    """This rank's share of a step; returns (metrics, the log-probs of every rank's micro-batches
    on rank 0 when `gather`, else {})."""
    mine = share_of(batches, dp.rank, dp.world_size)
    seen: dict[tuple[str, ...], torch.Tensor] = {}
    if dp.reference is not None:  # this rank scores its own share (training/dist_reference.py)
        if batch_inputs:
            raise ValueError(f"batch inputs {sorted(batch_inputs)} sent from rank 0 while every rank holds "
                             "the KL reference: compute them on the ranks, or keep the reference on rank 0")
        batches, batch_inputs = local_reference_inputs(dp, mine, options)
    loss_fn = with_batch_inputs(loss_fn, batches, batch_inputs)
    if gather:
        loss_fn = capture_logprobs(loss_fn, seen)
    metrics = forward_backward(dp.model, mine, loss_fn, options.step, ranks=dp)
    metrics |= optim_step(dp.model, optimizer, scheduler, options.max_grad_norm)
    if gather:  # a list of small dicts: every rank's [T] log-probs, once per step
        parts = [None] * dp.world_size if dp.rank == 0 else None
        dist.gather_object(seen, parts, dst=0)
        seen = {key: value for part in (parts or []) for key, value in part.items()}
    if dp.kind == "fsdp2":  # rank 0's engines and checkpoints read whole weights
        refresh_view(dp.model, dp.view)
    return metrics, seen
