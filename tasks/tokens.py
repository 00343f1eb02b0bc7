"""The `train` stage's table: the exact micro-batches an RL step trained on, with the trainer's
per-token log-probs, as `train_tokens` — what `rlpipe replay` rebuilds the step from, and what
the `tokens` view (storage/views.py) unnests to one row per trained completion token.

    train = train_task(trainer, batches, loss_fn, samples=samples, trainer_logprobs={}, step=..., run_dir=..., run_id=...)

The stage (tasks/train.py) declares `TRAIN_TOKENS`, so the stage wrapper writes the rows after
the step (storage/stage_tables.py). The trainer's log-probs are taken where the loss receives them
(training/loss_inputs.py `capture_logprobs`, a pass-through wrapper, so the step is computed
exactly as without it) into the stage's `trainer_logprobs` argument, keyed by the micro-batch's
sample_ids (unique in a run, and they survive `batch.to(device)`); with several epochs the last
epoch's are kept, the one whose loss and grad norm are logged. Under `train.parallel` every rank
captures its share and rank 0 gathers them after the step, so every trained micro-batch has them;
a skipped step (no update) gets null trainer log-probs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from rlpipe.envs.multiturn import segment_bounds
from rlpipe.rollouts.records import TrainSample
from rlpipe.storage.stage_tables import StageTable
from rlpipe.training.batch import PackedBatch
from rlpipe.training.losses import loss_token_mask, sequence_index


def completion_ends(samples: list[TrainSample]) -> dict[str, int]:
    """Per training-sequence sample id (`<id>` or `<id>#k`, tasks/pack.py), where its slice of the
    completion ends: a sequence always ends with completion[start:end]."""
    out = {}
    for sample in samples:
        bounds = segment_bounds(sample.rollout.turns, len(sample.rollout.completion_tokens))
        for k, (_, end) in enumerate(bounds):
            out[sample.sample_id if k == 0 else f"{sample.sample_id}#{k}"] = end
    return out


def token_map(batch: PackedBatch, ends: dict[str, int]) -> tuple[list[int], list[int]]:
    """Per token t: the segment whose completion token labels[t] is (a loss token of a sample),
    and that token's position in the completion; -1, -1 elsewhere."""
    seg = sequence_index(batch)
    cu = batch.cu_seqlens.to(torch.int64)
    length = (cu[1:] - cu[:-1])[seg]
    local = torch.arange(batch.n_tokens) - cu[:-1][seg]
    end = torch.tensor([ends.get(sid, -1) if sid else -1 for sid in batch.sample_ids], dtype=torch.int64)[seg]
    valid = loss_token_mask(batch) & (end >= 0)
    position = torch.where(valid, end - length + local + 1, -1)
    return torch.where(valid, seg, -1).tolist(), position.tolist()


def _list(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


def train_token_rows(samples: list[TrainSample], batches: list[PackedBatch],
                     trainer_logprobs: dict[tuple[str, ...], torch.Tensor]) -> list[dict]:
    """One `train_tokens` row per micro-batch, with the trainer's log-probs `capture_logprobs`
    kept for it (null where the loss never saw it here)."""
    ends = completion_ends(samples)
    rows = []
    for i, batch in enumerate(batches):
        token_sample, token_position = token_map(batch, ends)
        rows.append({
            "batch_id": i, "sample_ids": list(batch.sample_ids), "tokens": _list(batch.tokens),
            "position_ids": _list(batch.position_ids), "cu_seqlens": _list(batch.cu_seqlens),
            "labels": _list(batch.labels), "token_weights": _list(batch.token_weights),
            "log_probs": _list(batch.log_probs), "rewards": _list(batch.rewards),
            "prefix_index": _list(batch.prefix_index), "loss_mask": _list(batch.loss_mask),
            "trainer_logprobs": _list(trainer_logprobs.get(tuple(batch.sample_ids))),
            "token_sample": token_sample, "token_position": token_position,
        })
    return rows


def packed_batch(row: dict) -> PackedBatch:
    """The PackedBatch a `train_tokens` row holds, tensor for tensor (dtypes as training.batch)."""
    def tensor(name: str, dtype: torch.dtype) -> torch.Tensor | None:
        return None if row[name] is None else torch.tensor(row[name], dtype=dtype)

    return PackedBatch(
        tokens=tensor("tokens", torch.int64), position_ids=tensor("position_ids", torch.int64),
        cu_seqlens=tensor("cu_seqlens", torch.int32), labels=tensor("labels", torch.int64),
        token_weights=tensor("token_weights", torch.float32), log_probs=tensor("log_probs", torch.float32),
        rewards=tensor("rewards", torch.float32), sample_ids=list(row["sample_ids"]),
        prefix_index=tensor("prefix_index", torch.int64), loss_mask=tensor("loss_mask", torch.bool),
    )


def stage_token_rows(metrics: Any, arguments: Mapping[str, Any]) -> list[dict]:
    """The `train_tokens` rows of a `train` stage run, from its arguments: the step's `samples`,
    the `batches` it trained on and the `trainer_logprobs` the step filled."""
    return train_token_rows(arguments["samples"], arguments["batches"], arguments["trainer_logprobs"])


TRAIN_TOKENS = StageTable("train_tokens", rows=stage_token_rows)
"""Written after every train step; never read back (a resumed step trains again)."""
