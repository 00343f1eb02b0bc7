"""pack(): first-fit-decreasing micro-batches, no padding, causal shift done once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlpipe.training.batch import (
    IGNORE_INDEX,
    PackedBatch,
    Sequence,
    assign_bins,
    pack,
)
from rlpipe.training.padding import pack_stats, pad_batch, padding_fraction


def _seq(n: int, start: int = 0, sample_id: str | None = None, rl: bool = False) -> Sequence:
    tokens = list(range(start, start + n))
    weights = [float(t % 3) for t in tokens]
    if not rl:
        return Sequence(tokens=tokens, weights=weights, sample_id=sample_id)
    return Sequence(
        tokens=tokens,
        weights=weights,
        logprobs=[-0.5 * t for t in tokens],
        reward=float(n),
        sample_id=sample_id,
    )


def _unpack(batch: PackedBatch) -> list[list[int]]:
    cu = batch.cu_seqlens.tolist()
    return [batch.tokens[a:b].tolist() for a, b in zip(cu[:-1], cu[1:], strict=True)]


def test_shift_labels_weights_logprobs_per_sequence():
    seqs = [_seq(4, 10, "a", rl=True), _seq(3, 50, "b", rl=True)]
    (b,) = pack(seqs, token_budget=16)
    assert b.tokens.tolist() == [10, 11, 12, 13, 50, 51, 52]
    assert b.labels.tolist() == [11, 12, 13, IGNORE_INDEX, 51, 52, IGNORE_INDEX]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert b.cu_seqlens.tolist() == [0, 4, 7]
    # weights[t+1] moved to t; 0 at every last token
    assert b.token_weights.tolist() == [2.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert b.log_probs.tolist() == [-5.5, -6.0, -6.5, 0.0, -25.5, -26.0, 0.0]
    assert b.rewards.tolist() == [4.0, 3.0]
    assert b.sample_ids == ["a", "b"]
    assert b.tokens.dtype == torch.int64 and b.position_ids.dtype == torch.int64
    assert b.cu_seqlens.dtype == torch.int32 and b.labels.dtype == torch.int64
    assert b.token_weights.dtype == torch.float32 and b.log_probs.dtype == torch.float32
    assert (b.n_sequences, b.n_tokens) == (2, 7)


def test_pretrain_batch_has_no_rl_fields():
    (b,) = pack([_seq(5)], token_budget=5)
    assert b.log_probs is None and b.rewards is None
    assert b.sample_ids == [""]


def test_first_fit_decreasing_bins():
    # 6 goes first, 5 cannot join it (budget 10), 4 joins 6, 3 joins 5, 2 joins 5+3.
    assert assign_bins([3, 6, 5, 2, 4], 10) == [[1, 4], [0, 2, 3]]


def test_too_long_sequence_names_it():
    with pytest.raises(ValueError, match=r"sequence 1 \(sample_id 'long'\) has 9 tokens.*token_budget=8"):
        pack([_seq(3), _seq(9, sample_id="long")], token_budget=8)


def test_empty_input_and_empty_sequence_rejected():
    with pytest.raises(ValueError, match="no sequences"):
        pack([], token_budget=8)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        pack([Sequence(tokens=[], weights=[])], token_budget=8)
    with pytest.raises(ValueError, match="weights has 2 entries for 3 tokens"):
        Sequence(tokens=[1, 2, 3], weights=[1.0, 1.0])


def test_to_moves_every_tensor():
    (b,) = pack([_seq(3, rl=True)], token_budget=4)
    moved = b.to("cpu")
    assert moved is not b and torch.equal(moved.tokens, b.tokens)
    assert moved.sample_ids == b.sample_ids and moved.sample_ids is not b.sample_ids


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=25),
    budget=st.integers(40, 120),
)
def test_pack_properties(lens, budget):
    seqs = [_seq(n, start=1000 * i, sample_id=f"s{i}", rl=True) for i, n in enumerate(lens)]
    batches = pack(seqs, budget)
    again = pack(seqs, budget)  # deterministic
    assert [b.sample_ids for b in batches] == [b.sample_ids for b in again]
    seen: dict[str, list[int]] = {}
    for b in batches:
        assert b.n_tokens <= budget
        cu = b.cu_seqlens
        assert int(cu[0]) == 0 and int(cu[-1]) == b.n_tokens
        assert torch.all(cu[1:] > cu[:-1])
        lens_b = (cu[1:] - cu[:-1]).tolist()
        expected_pos = torch.cat([torch.arange(n) for n in lens_b])
        assert torch.equal(b.position_ids, expected_pos)
        for sid, toks, (a, e) in zip(b.sample_ids, _unpack(b), zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True), strict=True):
            seen[sid] = toks
            assert b.labels[a : e - 1].tolist() == toks[1:]
            assert int(b.labels[e - 1]) == IGNORE_INDEX and float(b.token_weights[e - 1]) == 0.0
        assert len(b.sample_ids) == b.n_sequences == b.rewards.numel()
    # every sequence appears exactly once, whole
    assert sorted(seen) == sorted(s.sample_id for s in seqs)
    assert sum(b.n_sequences for b in batches) == len(seqs)
    for s in seqs:
        assert seen[s.sample_id] == s.tokens


def test_pack_stats_and_padding_fraction():
    seqs = [_seq(n) for n in (10, 30, 20, 40)]
    stats = pack_stats(seqs, token_budget=50)
    assert stats.n_tokens == 100 and stats.padded_slots == 160
    assert stats.n_micro_batches == 2 and stats.pack_fill == pytest.approx(1.0)
    assert stats.padding_fraction == pytest.approx(padding_fraction(seqs)) == pytest.approx(0.375)


def test_pad_batch_matches_pack_shift():
    seqs = [_seq(3, 10), _seq(5, 20)]
    p = pad_batch(seqs, pad_id=0)
    (b,) = pack(seqs, token_budget=8)
    assert p.input_ids.tolist() == [[10, 11, 12, 0, 0], [20, 21, 22, 23, 24]]
    assert p.attention_mask.sum().item() == 8
    got = torch.cat([p.labels[0, :3], p.labels[1, :5]])
    assert torch.equal(got, b.labels)
    assert torch.equal(torch.cat([p.weights[0, :3], p.weights[1, :5]]), b.token_weights)
