"""Stages of supervised training (pretrain and SFT): pick the step's sequences, pack, train.

Which sequences a step trains on is a pure function of (seed, step): a per-epoch shuffle,
so a resumed run replays exactly the batches the interrupted one would have seen.
"""

from __future__ import annotations

import random

from rlpipe.tasks._prefect import stage
from rlpipe.tasks.train import train_on_batches
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.distributed import balanced_budget


def step_indices(n_items: int, per_step: int, step: int, seed: int) -> tuple[list[int], dict]:
    """Indices of the items of optimizer step `step` (1-based) and the data cursor after it."""
    if n_items == 0:
        raise ValueError("empty dataset: no sequences to train on")
    indices: list[int] = []
    position = (step - 1) * per_step
    while len(indices) < per_step:
        epoch, offset = divmod(position, n_items)
        order = list(range(n_items))
        random.Random(f"data/{seed}/{epoch}").shuffle(order)
        take = min(per_step - len(indices), n_items - offset)
        indices += order[offset:offset + take]
        position += take
    epoch, offset = divmod(position, n_items)
    return indices, {"epoch": epoch, "offset": offset, "seed": seed, "position": position}


def supervised_train_step(
    model, optimizer, scheduler, sequences: list[Sequence], loss_fn, *, step: int, seed: int,
    per_step: int, token_budget: int, normaliser: str, max_grad_norm: float, autocast: bool, parallel=None,
) -> tuple[dict[str, float], dict]:
    """One optimizer step of pretrain/SFT; returns metrics and the data cursor. parallel: a
    DataParallel (tasks/ranks.py): the step is shared out over its ranks by tokens."""
    indices, cursor = step_indices(len(sequences), per_step, step, seed)
    chosen = [sequences[i] for i in indices]
    if parallel is not None:  # small enough micro-batches that every rank gets work
        token_budget = balanced_budget(sum(len(s.tokens) for s in chosen), max(len(s.tokens) for s in chosen),
                                       token_budget, parallel.world_size)
    batches = pack(chosen, token_budget)
    metrics = train_on_batches(model, optimizer, scheduler, batches, loss_fn, normaliser=normaliser,
                               max_grad_norm=max_grad_norm, autocast=autocast, step=step, parallel=parallel)
    metrics["micro_batches"] = len(batches)
    return metrics, cursor


@stage("train")
def supervised_train_task(model, optimizer, scheduler, sequences, loss_fn, **kwargs):
    return supervised_train_step(model, optimizer, scheduler, sequences, loss_fn, **kwargs)
