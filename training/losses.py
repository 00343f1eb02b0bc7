"""Token-weighted losses and the normalisers that turn them into one scalar per optimizer step.

A loss function is pure: `loss_fn(logprobs [T], batch) -> (per_token_loss [T], metrics)`. It
never shifts (packing did) and never normalises; `reduce_loss` does, with totals computed once
per optimizer step by `normaliser_totals`, so that the sum of `reduce_loss` over the
micro-batches of a step equals the loss of the whole step as one batch (gradient accumulation
is exact whatever the micro-batch split).

Normalisers (docs/DESIGN.md "Algorithm = advantages + loss"):
- `token`:    Σ loss / number of loss tokens in the whole step.
- `sequence`: mean over each sequence's loss tokens, then mean over the step's sequences
              (sequences with no loss token are left out: they carry no signal).
- `constant`: Σ loss / a constant (e.g. max tokens per step), the same for every step.

Loss tokens are those with `labels != -100` and `token_weights != 0`, or, when the batch has a
`loss_mask` (RL: every completion token, so a zero advantage still counts in the normaliser, as in
TRL's `dapo` and DAPO's token-level mean), `labels != -100` and `loss_mask`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from rlpipe.training.batch import IGNORE_INDEX, PackedBatch
from rlpipe.training.loss_choice import Normaliser

NORMALISERS: tuple[str, ...] = ("token", "sequence", "constant")

LossFn = Callable[[torch.Tensor, PackedBatch], tuple[torch.Tensor, dict[str, float]]]


def loss_token_mask(batch: PackedBatch) -> torch.Tensor:
    """bool [T]: the tokens a loss is computed on (a label, and a non-zero weight or the batch's
    loss_mask)."""
    if batch.loss_mask is not None:
        return (batch.labels != IGNORE_INDEX) & batch.loss_mask.to(batch.labels.device)
    return (batch.labels != IGNORE_INDEX) & (batch.token_weights != 0)


def sequence_index(batch: PackedBatch) -> torch.Tensor:
    """int64 [T]: the index of the sequence each token belongs to."""
    cu = batch.cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)


def nll_loss(logprobs: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted negative log-likelihood: per_token = −token_weights · logprobs.

    logprobs float32 [T] (0 at ignored labels) → (per_token_loss [T], metrics). Metrics: `nll`,
    the unweighted mean −logprob over this micro-batch's loss tokens.
    """
    weights = batch.token_weights.to(logprobs.device, logprobs.dtype)
    per_token = -weights * logprobs
    mask = loss_token_mask(batch).to(logprobs.device)
    n = int(mask.sum())
    nll = float(-(logprobs.detach()[mask]).sum() / n) if n else 0.0
    return per_token, {"nll": nll}


sft_loss = nll_loss


def _check_mode(mode: str) -> None:
    if mode not in NORMALISERS:
        raise ValueError(f"unknown normaliser {mode!r}; expected one of {NORMALISERS}")


def batch_counts(batch: PackedBatch) -> dict[str, int]:
    """Counts of one micro-batch: tokens, loss_tokens, sequences (all) and loss_sequences
    (sequences with at least one loss token)."""
    mask = loss_token_mask(batch)
    per_seq = torch.zeros(batch.n_sequences, dtype=torch.int64, device=mask.device)
    per_seq.index_add_(0, sequence_index(batch).to(mask.device), mask.to(torch.int64))
    return {
        "tokens": batch.n_tokens,
        "loss_tokens": int(mask.sum()),
        "sequences": batch.n_sequences,
        "loss_sequences": int((per_seq > 0).sum()),
    }


def normaliser_totals(batches: Iterable[PackedBatch], mode: Normaliser = "token") -> dict[str, int]:
    """Counts over all micro-batches of one optimizer step (compute once per step).

    Returns {tokens, loss_tokens, sequences, loss_sequences}. Raises ValueError for an unknown
    mode, no batches, or (for `token` / `sequence`) a step without any loss token, whose loss
    would be 0/0.
    """
    _check_mode(mode)
    totals = {"tokens": 0, "loss_tokens": 0, "sequences": 0, "loss_sequences": 0}
    n_batches = 0
    for batch in batches:
        n_batches += 1
        for key, value in batch_counts(batch).items():
            totals[key] += value
    if n_batches == 0:
        raise ValueError("normaliser_totals: no micro-batches in this step")
    if mode != "constant" and totals["loss_tokens"] == 0:
        raise ValueError(
            f"normaliser {mode!r}: the step has no loss tokens (every label is -100 or every "
            "token weight is 0); nothing to train on"
        )
    return totals


def reduce_loss(
    per_token_loss: torch.Tensor,
    batch: PackedBatch,
    mode: Normaliser,
    totals: dict[str, int],
    constant: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss (a scalar); summing over the step's
    micro-batches gives the step loss. per_token_loss [T]; totals from `normaliser_totals`."""
    _check_mode(mode)
    mask = loss_token_mask(batch).to(per_token_loss.device)
    # where() rather than multiply: a masked-out NaN/inf must not leak into the sum.
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token":
        return masked.sum() / totals["loss_tokens"]
    if mode == "constant":
        if constant is None or not constant > 0:
            raise ValueError(f"normaliser 'constant' needs a constant > 0; got {constant!r}")
        return masked.sum() / constant
    seq = sequence_index(batch).to(per_token_loss.device)
    n = batch.n_sequences
    seq_sum = torch.zeros(n, dtype=masked.dtype, device=masked.device).index_add(0, seq, masked)
    seq_cnt = torch.zeros(n, dtype=masked.dtype, device=masked.device).index_add(
        0, seq, mask.to(masked.dtype)
    )
    return (seq_sum / seq_cnt.clamp(min=1)).sum() / totals["loss_sequences"]
