"""The one batch contract: `Sequence` records packed into `PackedBatch` micro-batches.

Every data source (pretrain documents, SFT chats, RL rollouts) yields `Sequence`s; `pack()`
concatenates them, without padding, into micro-batches of at most `token_budget` tokens, and does
the causal shift once (`labels[t] = tokens[t+1]`), so a loss never shifts again. See DESIGN.md,
"The one batch contract".

`pad_batch()` builds the conventional padded batch of the same sequences; it is the baseline the
packing benchmark and the packed-equals-unpacked tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


@dataclass
class Sequence:
    """One training sequence before packing.

    tokens:    the whole sequence (prompt + completion, or a document).
    weights:   weight of the loss on predicting tokens[i] (same length; weights[0] is unused).
    logprobs:  generator's log-prob of tokens[i] (0 where none), RL only.
    reward:    sequence reward, RL only.
    sample_id: lineage (the rollout row), RL only.
    """

    tokens: list[int]
    weights: list[float]
    logprobs: list[float] | None = None
    reward: float | None = None
    sample_id: str | None = None

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.tokens):
            raise ValueError(
                f"Sequence {self.sample_id!r}: weights has {len(self.weights)} entries "
                f"for {len(self.tokens)} tokens"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(
                f"Sequence {self.sample_id!r}: logprobs has {len(self.logprobs)} entries "
                f"for {len(self.tokens)} tokens"
            )


@dataclass
class PackedBatch:
    """Sequences concatenated into one row, no padding (T tokens, n sequences).

    tokens:        int64 [T]
    position_ids:  int64 [T]    restart at 0 at each sequence start
    cu_seqlens:    int32 [n+1]  boundaries; cu_seqlens[0] = 0, cu_seqlens[-1] = T
    labels:        int64 [T]    tokens[t+1] inside a sequence, -100 at each sequence's last token
    token_weights: float32 [T]  weight of the loss on labels[t] (0 at each last token)
    log_probs:     float32 [T] | None  generator's log-prob of labels[t] (0 where none)
    rewards:       float32 [n] | None
    sample_ids:    list[str] [n] (empty strings where a sequence had none)
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    token_weights: torch.Tensor
    log_probs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    sample_ids: list[str] = field(default_factory=list)

    @property
    def n_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def seq_lens(self) -> list[int]:
        """Length of each sequence, in order."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens) if self.n_sequences else 0

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on `device` (cu_seqlens included)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return PackedBatch(
            tokens=move(self.tokens),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            labels=move(self.labels),
            token_weights=move(self.token_weights),
            log_probs=move(self.log_probs),
            rewards=move(self.rewards),
            sample_ids=list(self.sample_ids),
        )


def _seq_name(index: int, seq: Sequence) -> str:
    return f"sequence {index}" + (f" (sample_id {seq.sample_id!r})" if seq.sample_id else "")


def assign_bins(lengths: SequenceABC[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing: indices of `lengths` grouped into bins of total <= token_budget.

    Deterministic: ties in length keep input order; bins are returned in creation order and
    the indices inside a bin in input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(token_budget - n)
    return [sorted(b) for b in bins]


def _check(sequences: SequenceABC[Sequence], token_budget: int) -> None:
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if len(sequences) == 0:
        raise ValueError("pack: no sequences to pack")
    for i, seq in enumerate(sequences):
        if len(seq.tokens) == 0:
            raise ValueError(f"pack: {_seq_name(i, seq)} is empty")
        if len(seq.tokens) > token_budget:
            raise ValueError(
                f"pack: {_seq_name(i, seq)} has {len(seq.tokens)} tokens, "
                f"more than token_budget={token_budget}"
            )


def pack_one(sequences: SequenceABC[Sequence]) -> PackedBatch:
    """Concatenate `sequences` (in the given order) into one PackedBatch, shifting labels."""
    lens = [len(s.tokens) for s in sequences]
    total = sum(lens)
    tokens = torch.tensor([t for s in sequences for t in s.tokens], dtype=torch.int64)
    weights = torch.tensor([w for s in sequences for w in s.weights], dtype=torch.float32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    starts = torch.repeat_interleave(cu[:-1].to(torch.int64), torch.tensor(lens))
    position_ids = torch.arange(total, dtype=torch.int64) - starts
    last = (cu[1:] - 1).to(torch.int64)  # each sequence's last token: nothing to predict

    labels = torch.empty(total, dtype=torch.int64)
    labels[:-1] = tokens[1:]
    labels[last] = IGNORE_INDEX
    token_weights = torch.zeros(total, dtype=torch.float32)
    token_weights[:-1] = weights[1:]
    token_weights[last] = 0.0

    log_probs = None
    if any(s.logprobs is not None for s in sequences):
        lp = torch.tensor(
            [x for s in sequences for x in (s.logprobs if s.logprobs is not None else [0.0] * len(s.tokens))],
            dtype=torch.float32,
        )
        log_probs = torch.zeros(total, dtype=torch.float32)
        log_probs[:-1] = lp[1:]
        log_probs[last] = 0.0

    rewards = None
    if any(s.reward is not None for s in sequences):
        rewards = torch.tensor(
            [s.reward if s.reward is not None else 0.0 for s in sequences], dtype=torch.float32
        )
    return PackedBatch(
        tokens=tokens,
        position_ids=position_ids,
        cu_seqlens=cu,
        labels=labels,
        token_weights=token_weights,
        log_probs=log_probs,
        rewards=rewards,
        sample_ids=[s.sample_id or "" for s in sequences],
    )


def pack(sequences: SequenceABC[Sequence], token_budget: int) -> list[PackedBatch]:
    """Pack sequences into micro-batches of at most `token_budget` tokens each, no padding.

    First-fit-decreasing bin packing; no sequence is split. Deterministic for a given input.
    Raises ValueError on empty input or a sequence longer than the budget (naming it).
    """
    _check(sequences, token_budget)
    bins = assign_bins([len(s.tokens) for s in sequences], token_budget)
    return [pack_one([sequences[i] for i in b]) for b in bins]


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
    _check(sequences, token_budget)
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
