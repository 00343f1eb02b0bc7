"""The one batch contract: `Sequence` records packed into `PackedBatch` micro-batches.

Every data source (pretrain documents, SFT chats, RL rollouts) yields `Sequence`s; `pack()`
concatenates them, without padding, into micro-batches of at most `token_budget` tokens, and does
the causal shift once (`labels[t] = tokens[t+1]`), so a loss never shifts again. See docs/DESIGN.md,
"The one batch contract".

Shared prefixes: the completions of one RL group repeat the same prompt. A `Sequence` may declare
`prefix_len` (its prompt, weightless); `pack` then lays the shared prompt out once per micro-batch,
as a *prefix segment* holding prompt[:-1], followed by one *continuation segment* per sequence
holding prompt[-1:] + completion (the last prompt token is repeated so that each continuation
predicts its own first token). `prefix_index` tells attention which segment each continuation
continues, and its position ids continue from the prefix. Projections, MLPs and the LM head then
run on the prompt once per group instead of once per completion; log-probs and gradients are those
of the unshared layout (a test checks both).

The padded baseline (`pad_batch()`, `pack_stats()`) that packing is measured against lives in
training/padding.py.
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
    prefix_len: leading tokens (an RL prompt) that `pack` may share with other sequences starting
               with the same tokens; 0 = none. Their weights (weights[1:prefix_len]) must be 0.
    loss_mask: whether predicting tokens[i] is a loss token (counted by the normalisers) even
               when its weight is 0 (RL: every completion token, a zero advantage included);
               None: the tokens with a non-zero weight.
    """

    tokens: list[int]
    weights: list[float]
    logprobs: list[float] | None = None
    reward: float | None = None
    sample_id: str | None = None
    prefix_len: int = 0
    loss_mask: list[bool] | None = None

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
        if self.loss_mask is not None and len(self.loss_mask) != len(self.tokens):
            raise ValueError(
                f"Sequence {self.sample_id!r}: loss_mask has {len(self.loss_mask)} entries "
                f"for {len(self.tokens)} tokens"
            )
        if not 0 <= self.prefix_len <= len(self.tokens):
            raise ValueError(
                f"Sequence {self.sample_id!r}: prefix_len {self.prefix_len} is outside "
                f"[0, {len(self.tokens)}]"
            )
        shared_loss = self.loss_mask is not None and any(self.loss_mask[1 : self.prefix_len])
        if shared_loss or any(w != 0 for w in self.weights[1 : self.prefix_len]):
            raise ValueError(
                f"Sequence {self.sample_id!r}: a shared prefix must carry no loss, but "
                f"weights[1:{self.prefix_len}] are not all 0"
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
    prefix_index:  int64 [n] | None  for a continuation segment, the index of the prefix segment
                   it continues (attends to; its position_ids start at that prefix's length);
                   -1 elsewhere. None: no shared prefixes, every segment is a whole sequence.
    loss_mask:     bool [T] | None  the loss tokens (labels[t] counted by the normalisers, 0 weight
                   or not); None: labels != -100 and token_weights != 0.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    token_weights: torch.Tensor
    log_probs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    sample_ids: list[str] = field(default_factory=list)
    prefix_index: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

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
            prefix_index=move(self.prefix_index),
            loss_mask=move(self.loss_mask),
        )

    def full_lengths(self) -> list[int]:
        """Length of each segment's whole sequence (a continuation's prefix included)."""
        lens = self.seq_lens
        if self.prefix_index is None:
            return lens
        return [n + (lens[p] if p >= 0 else 0) for n, p in zip(lens, self.prefix_index.tolist(), strict=True)]


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


def check_packable(sequences: SequenceABC[Sequence], token_budget: int) -> None:
    """ValueError unless every sequence fits `token_budget` (naming the first that does not)."""
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


def _shifted(values: torch.Tensor, last: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
    """The causal shift: values[t + 1] at t, and `fill` at each sequence's `last` token (the
    packed row's final token is always one)."""
    out = torch.full_like(values, fill)
    out[:-1] = values[1:]
    out[last] = fill
    return out


def pack_one(sequences: SequenceABC[Sequence], prefix_index: SequenceABC[int] | None = None) -> PackedBatch:
    """Concatenate `sequences` (in the given order) into one PackedBatch, shifting labels.

    prefix_index: per sequence, the index (in `sequences`, earlier) of the prefix segment it
    continues, or -1; its position ids then start at that segment's length. None: no prefixes.
    """
    lens = [len(s.tokens) for s in sequences]
    total = sum(lens)
    tokens = torch.tensor([t for s in sequences for t in s.tokens], dtype=torch.int64)
    weights = torch.tensor([w for s in sequences for w in s.weights], dtype=torch.float32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    offsets = [0] * len(lens) if prefix_index is None else [lens[j] if j >= 0 else 0 for j in prefix_index]
    first_position = torch.tensor(offsets, dtype=torch.int64) - cu[:-1].to(torch.int64)
    position_ids = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
        first_position, torch.tensor(lens)
    )
    last = (cu[1:] - 1).to(torch.int64)  # each sequence's last token: nothing to predict

    labels = _shifted(tokens, last, IGNORE_INDEX)
    token_weights = _shifted(weights, last, 0.0)

    log_probs = None
    if any(s.logprobs is not None for s in sequences):
        lp = torch.tensor(
            [x for s in sequences for x in (s.logprobs if s.logprobs is not None else [0.0] * len(s.tokens))],
            dtype=torch.float32,
        )
        log_probs = _shifted(lp, last, 0.0)

    loss_mask = None
    if any(s.loss_mask is not None for s in sequences):
        flags = torch.tensor(
            [m for s in sequences for m in (s.loss_mask if s.loss_mask is not None else [w != 0 for w in s.weights])],
            dtype=torch.bool,
        )
        loss_mask = _shifted(flags, last, False)

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
        prefix_index=None if prefix_index is None else torch.tensor(list(prefix_index), dtype=torch.int64),
        loss_mask=loss_mask,
    )


@dataclass(frozen=True)
class _Unit:
    """What bin packing places whole: one sequence, or a shared prefix with its continuations."""

    members: tuple[int, ...]  # indices into the input sequences, in input order
    prefix_len: int  # 0: a single whole sequence
    size: int  # tokens it occupies in a micro-batch


def _unit(sequences: SequenceABC[Sequence], members: list[int], prefix_len: int) -> _Unit:
    if len(members) == 1:
        return _Unit((members[0],), 0, len(sequences[members[0]].tokens))
    # the prefix segment holds prompt[:-1]; each continuation repeats prompt[-1]
    size = prefix_len - 1 + sum(len(sequences[i].tokens) - prefix_len + 1 for i in members)
    return _Unit(tuple(members), prefix_len, size)


def _split_group(
    sequences: SequenceABC[Sequence], members: list[int], prefix_len: int, token_budget: int
) -> list[_Unit]:
    """Units of at most `token_budget` tokens from one group sharing `prefix_len` tokens."""
    units: list[_Unit] = []
    chunk: list[int] = []
    for i in members:
        if chunk and _unit(sequences, chunk + [i], prefix_len).size > token_budget:
            units.append(_unit(sequences, chunk, prefix_len))
            chunk = []
        chunk.append(i)
    units.append(_unit(sequences, chunk, prefix_len))
    return units


def shared_prefix_units(sequences: SequenceABC[Sequence], token_budget: int) -> list[_Unit]:
    """Group sequences by their declared prefix (same prefix_len > 1, same prefix tokens).

    Deterministic; units come in the order of their first member.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    units: list[tuple[int, list[_Unit]]] = []
    for i, seq in enumerate(sequences):
        if seq.prefix_len > 1:
            groups.setdefault(tuple(seq.tokens[: seq.prefix_len]), []).append(i)
        else:
            units.append((i, [_unit(sequences, [i], 0)]))
    for key, members in groups.items():
        units.append((members[0], _split_group(sequences, members, len(key), token_budget)))
    return [u for _, group_units in sorted(units, key=lambda x: x[0]) for u in group_units]


def _pack_units(sequences: SequenceABC[Sequence], units: list[_Unit]) -> PackedBatch:
    segments: list[Sequence] = []
    prefix_index: list[int] = []
    for unit in units:
        if unit.prefix_len == 0:
            segments.append(sequences[unit.members[0]])
            prefix_index.append(-1)
            continue
        shared = unit.prefix_len - 1
        head = sequences[unit.members[0]]
        prefix_at = len(segments)
        segments.append(Sequence(tokens=head.tokens[:shared], weights=[0.0] * shared,
                                 loss_mask=None if head.loss_mask is None else [False] * shared))
        prefix_index.append(-1)
        for i in unit.members:
            seq = sequences[i]
            segments.append(
                Sequence(
                    tokens=seq.tokens[shared:],
                    weights=seq.weights[shared:],
                    logprobs=None if seq.logprobs is None else seq.logprobs[shared:],
                    reward=seq.reward,
                    sample_id=seq.sample_id,
                    loss_mask=None if seq.loss_mask is None else seq.loss_mask[shared:],
                )
            )
            prefix_index.append(prefix_at)
    shares = any(u.prefix_len for u in units)
    return pack_one(segments, prefix_index if shares else None)


def pack(
    sequences: SequenceABC[Sequence], token_budget: int, share_prefixes: bool = True
) -> list[PackedBatch]:
    """Pack sequences into micro-batches of at most `token_budget` tokens each, no padding.

    First-fit-decreasing bin packing; no sequence is split. Deterministic for a given input.
    With `share_prefixes`, sequences declaring the same prefix (`Sequence.prefix_len`) hold it
    once per micro-batch (see the module docstring); the log-probs and gradients are unchanged.
    Raises ValueError on empty input or a sequence longer than the budget (naming it).
    """
    check_packable(sequences, token_budget)
    if share_prefixes and any(s.prefix_len > 1 for s in sequences):
        units = shared_prefix_units(sequences, token_budget)
        bins = assign_bins([u.size for u in units], token_budget)
        return [_pack_units(sequences, [units[i] for i in b]) for b in bins]
    bins = assign_bins([len(s.tokens) for s in sequences], token_budget)
    return [pack_one([sequences[i] for i in b]) for b in bins]
