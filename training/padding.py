"""The padded baseline that packing is measured against: `pad_batch()` builds the conventional
right-padded batch of the same sequences (what the packing benchmark and the
packed-equals-unpacked tests compare with), `pack_stats()` / `padding_fraction()` say how much
padding packing saves. Training itself only ever sees `PackedBatch` (training/batch.py).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch
from rlpipe.training.batch import IGNORE_INDEX, Sequence, assign_bins, check_packable


@dataclass(frozen=True)
class PackStats:
    """What packing saves against padded batching of the same sequences.

    n_tokens:          real tokens
    n_micro_batches:   packed micro-batches
    packed_slots:      n_micro_batches * token_budget (capacity used by packing)
    padded_slots:      n_sequences * max_len (a single padded batch of the same sequences)
    padding_fraction:  1 - n_tokens / padded_slots (share of a padded batch that is padding)
    pack_fill:         n_tokens / packed_slots
    """

    n_sequences: int
    n_tokens: int
    n_micro_batches: int
    packed_slots: int
    padded_slots: int
    padding_fraction: float
    pack_fill: float


def pack_stats(sequences: SequenceABC[Sequence], token_budget: int) -> PackStats:
    """Statistics of packing `sequences` with `token_budget` versus padding them to max length."""
    check_packable(sequences, token_budget)
    lens = [len(s.tokens) for s in sequences]
    n_bins = len(assign_bins(lens, token_budget))
    n_tokens = sum(lens)
    padded = len(lens) * max(lens)
    return PackStats(
        n_sequences=len(lens),
        n_tokens=n_tokens,
        n_micro_batches=n_bins,
        packed_slots=n_bins * token_budget,
        padded_slots=padded,
        padding_fraction=1.0 - n_tokens / padded,
        pack_fill=n_tokens / (n_bins * token_budget),
    )


def padding_fraction(sequences: SequenceABC[Sequence]) -> float:
    """Share of a padded [n, max_len] batch of `sequences` that would be padding."""
    if len(sequences) == 0:
        raise ValueError("padding_fraction: no sequences")
    lens = [len(s.tokens) for s in sequences]
    return 1.0 - sum(lens) / (len(lens) * max(lens))


@dataclass
class PaddedBatch:
    """The conventional right-padded batch (baseline for benchmarks and tests).

    input_ids:      int64 [B, L]  (pad_id where padding)
    attention_mask: int64 [B, L]  1 on real tokens
    labels:         int64 [B, L]  shifted like PackedBatch: labels[b, t] = input_ids[b, t+1]; -100 at pads/last
    weights:        float32 [B, L] weight of the loss on labels[b, t]
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def pad_batch(sequences: SequenceABC[Sequence], pad_id: int = 0) -> PaddedBatch:
    """Right-pad `sequences` to their max length, with labels shifted as in `pack`."""
    if len(sequences) == 0:
        raise ValueError("pad_batch: no sequences")
    lens = [len(s.tokens) for s in sequences]
    width = max(lens)
    b = len(sequences)
    input_ids = torch.full((b, width), pad_id, dtype=torch.int64)
    mask = torch.zeros((b, width), dtype=torch.int64)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64)
    weights = torch.zeros((b, width), dtype=torch.float32)
    for i, (s, n) in enumerate(zip(sequences, lens, strict=True)):
        toks = torch.tensor(s.tokens, dtype=torch.int64)
        input_ids[i, :n] = toks
        mask[i, :n] = 1
        labels[i, : n - 1] = toks[1:]
        weights[i, : n - 1] = torch.tensor(s.weights[1:], dtype=torch.float32)
    return PaddedBatch(input_ids=input_ids, attention_mask=mask, labels=labels, weights=weights)
