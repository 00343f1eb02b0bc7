"""What a step's loss function sees besides the log-probs: per micro-batch inputs bound by
sample_ids, the trainer's log-probs kept on the way, and the zero-weight filler micro-batch a
data-parallel rank runs when it has fewer than the others (training/distributed.py).

    loss_fn = bind_batch_inputs(loss_fn, batches, old_logprobs=[...])   # one tensor per micro-batch
    loss_fn = with_batch_inputs(loss_fn, batches, {"ref_logprobs": [...]})
    loss_fn = capture_logprobs(loss_fn, sink)       # sink[sample_ids] = trainer log-probs
"""

from __future__ import annotations

from collections import abc

import torch
from rlpipe.training.batch import PackedBatch, Sequence, pack
from rlpipe.training.losses import LossFn

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


def _batch_key(batch: PackedBatch) -> tuple[str, ...]:
    """A micro-batch's rollouts (shared-prefix segments carry no sample_id)."""
    return tuple(s for s in batch.sample_ids if s)


def bind_batch_inputs(loss_fn: LossFn, batches: abc.Sequence[PackedBatch], **per_batch: abc.Sequence[torch.Tensor]) -> LossFn:
    """A loss_fn that passes each micro-batch its own tensors (e.g. old_logprobs=[...],
    ref_logprobs=[...], one [T] tensor per micro-batch, in the order of `batches`).

    For PPO epochs / TIS / KL: compute them once per batch, under no_grad, before the first
    update; then train with the bound loss_fn. Micro-batches are matched by their sample_ids
    (unique within a run), which survive `batch.to(device)`.
    """
    table: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
    for name, tensors in per_batch.items():
        if len(batches) != len(tensors):
            raise ValueError(f"{len(batches)} micro-batches for {len(tensors)} {name} tensors")
    for i, b in enumerate(batches):
        key = _batch_key(b)
        if not key or key in table:
            raise ValueError("bind_batch_inputs needs micro-batches with unique, non-empty sample_ids")
        table[key] = {}
        for name, tensors in per_batch.items():
            if tensors[i].shape != b.tokens.shape:
                raise ValueError(
                    f"{name} shape {tuple(tensors[i].shape)} != tokens shape {tuple(b.tokens.shape)}")
            table[key][name] = tensors[i].detach()

    def bound(logprobs: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        key = _batch_key(batch)
        if key not in table:
            names = " / ".join(per_batch)
            raise ValueError(f"no {names} bound for micro-batch with sample_ids {list(key)[:3]}...")
        return loss_fn(logprobs, batch, **table[key])  # type: ignore[call-arg]

    return bound


def bind_old_logprobs(
    loss_fn: LossFn, batches: abc.Sequence[PackedBatch], old_logprobs: abc.Sequence[torch.Tensor]
) -> LossFn:
    """`bind_batch_inputs(loss_fn, batches, old_logprobs=old_logprobs)`."""
    return bind_batch_inputs(loss_fn, batches, old_logprobs=old_logprobs)
