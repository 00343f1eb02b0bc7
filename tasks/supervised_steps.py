"""Stages of supervised training (pretrain and SFT): pick the step's sequences, pack, train.

Which sequences a step trains on is a pure function of (seed, step): a per-epoch shuffle,
so a resumed run replays exactly the batches the interrupted one would have seen.
"""

from __future__ import annotations

import random

from rlpipe.storage.stage_tables import stage
from rlpipe.tasks.train import train_on_batches
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.trainer import Trainer


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


def supervised_train_step(trainer: Trainer, sequences: list[Sequence], loss_fn, *, step: int, seed: int,
                          per_step: int, token_budget: int) -> tuple[dict[str, float], dict]:
    """One optimizer step of pretrain/SFT; returns metrics and the data cursor. The trainer sizes
    the micro-batches (data-parallel: small enough that every rank gets work)."""
    indices, cursor = step_indices(len(sequences), per_step, step, seed)
    chosen = [sequences[i] for i in indices]
    batches = pack(chosen, trainer.budget([len(s.tokens) for s in chosen], token_budget))
    metrics = train_on_batches(trainer, batches, loss_fn, step=step)
    metrics["micro_batches"] = len(batches)
    return metrics, cursor


@stage("train")
def supervised_train_task(trainer: Trainer, sequences: list[Sequence], loss_fn, **kwargs):
    """The `train` stage of pretrain/SFT: `supervised_train_step`."""
    return supervised_train_step(trainer, sequences, loss_fn, **kwargs)
