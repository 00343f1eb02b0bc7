"""What a step's loss function sees besides the log-probs: per micro-batch inputs bound by
sample_ids, the trainer's log-probs kept on the way, and the zero-weight filler micro-batch a
data-parallel rank runs when it has fewer than the others (training/distributed.py).

    loss_fn = with_batch_inputs(loss_fn, batches, {"ref_logprobs": [...]})
    loss_fn = capture_logprobs(loss_fn, sink)       # sink[sample_ids] = trainer log-probs
"""

from __future__ import annotations

import torch
from rlpipe.training.batch import PackedBatch, Sequence, pack
from rlpipe.training.rl_loss import bind_batch_inputs

FILLER_ID = "<filler>"
"""sample_id of the zero-weight micro-batch a rank runs when it has fewer than the others."""


def is_filler(batch: PackedBatch) -> bool:
    """Whether `batch` is a filler micro-batch (no loss tokens, lines up collectives)."""
    return list(batch.sample_ids) == [FILLER_ID]


def filler_batch() -> PackedBatch:
    """A two-token micro-batch of weight 0 under `FILLER_ID`."""
    return pack([Sequence(tokens=[0, 0], weights=[0.0, 0.0], sample_id=FILLER_ID)], 2)[0]


def with_batch_inputs(loss_fn, batches: list[PackedBatch], inputs: dict[str, list[torch.Tensor]]):
    """`loss_fn` with each micro-batch's `inputs` bound by sample_ids; a filler (no loss
    tokens, so no input matters) gets zeros."""
    if not inputs:
        return loss_fn
    bound = bind_batch_inputs(loss_fn, batches, **inputs)

    def loss(logprobs: torch.Tensor, batch: PackedBatch):
        if is_filler(batch):
            return loss_fn(logprobs, batch, **{name: torch.zeros_like(logprobs) for name in inputs})
        return bound(logprobs, batch)
    return loss


def capture_logprobs(loss_fn, sink: dict[tuple[str, ...], torch.Tensor]):
    """`loss_fn` that first keeps the trainer's log-probs it is given (detached, CPU float32) in
    `sink`, under the micro-batch's sample_ids (fillers are not kept). A pass-through: the step
    is computed exactly as without it."""
    def loss(logprobs: torch.Tensor, batch: PackedBatch, **kwargs):
        if not is_filler(batch):
            sink[tuple(batch.sample_ids)] = logprobs.detach().to("cpu", torch.float32)
        return loss_fn(logprobs, batch, **kwargs)
    return loss
