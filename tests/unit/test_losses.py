"""Losses are pure per-token functions; normalisers make micro-batch sums equal whole-step losses."""

from __future__ import annotations

import pytest
import torch
from rlpipe.training.batch import Sequence, pack, pack_one
from rlpipe.training.losses import (
    loss_token_mask,
    nll_loss,
    normaliser_totals,
    reduce_loss,
    sft_loss,
)


def _sequences(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        toks = torch.randint(0, 50, (length,), generator=g).tolist()
        # a prompt of 0 weights, then weighted completion tokens of varying weight
        cut = length // 2
        weights = [0.0] * cut + torch.rand(length - cut, generator=g).add(0.5).tolist()
        seqs.append(Sequence(tokens=toks, weights=weights, sample_id=f"s{i}"))
    # one sequence with no loss token at all (all weights 0)
    seqs.append(Sequence(tokens=[1, 2, 3, 4], weights=[0.0] * 4, sample_id="empty"))
    return seqs


def _fake_logprobs(batch, seed=0):
    g = torch.Generator().manual_seed(seed + batch.n_tokens)
    lp = -torch.rand(batch.n_tokens, generator=g) * 3
    return torch.where(batch.labels != -100, lp, torch.zeros_like(lp))


def _per_token_lookup(seqs):
    """Deterministic per-token 'logprob' keyed by (sample_id, position), independent of packing."""
    table = {}
    for s in seqs:
        for t in range(len(s.tokens)):
            table[(s.sample_id, t)] = -(((sum(map(ord, s.sample_id)) * 31 + t * 17) % 1000) / 400.0)
    return table


def _logprobs_for(batch, table):
    out = torch.zeros(batch.n_tokens)
    cu = batch.cu_seqlens.tolist()
    for j, sid in enumerate(batch.sample_ids):
        for t in range(cu[j], cu[j + 1] - 1):
            out[t] = table[(sid, t - cu[j] + 1)]  # log-prob of labels[t] = tokens[t+1]
    return out


def test_nll_is_negative_weighted_logprob():
    (batch,) = pack(_sequences(), token_budget=1000)
    lp = _fake_logprobs(batch)
    per_token, metrics = nll_loss(lp, batch)
    torch.testing.assert_close(per_token, -batch.token_weights * lp)
    mask = loss_token_mask(batch)
    assert metrics["nll"] == pytest.approx(float(-lp[mask].mean()), rel=1e-6)
    assert sft_loss is nll_loss


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_micro_batch_sum_equals_whole_step(mode):
    seqs = _sequences()
    table = _per_token_lookup(seqs)
    micro = pack(seqs, token_budget=24)
    assert len(micro) >= 4
    whole = [pack_one(seqs)]

    def step_loss(batches):
        totals = normaliser_totals(batches, mode)
        return sum(
            reduce_loss(nll_loss(_logprobs_for(b, table), b)[0], b, mode, totals, constant=100.0)
            for b in batches
        )

    assert float(step_loss(micro)) == pytest.approx(float(step_loss(whole)), rel=1e-6)


def test_normalisers_by_hand():
    # seq A: 2 loss tokens with losses 1 and 3; seq B: 1 loss token with loss 5.
    a = Sequence(tokens=[0, 1, 2], weights=[0.0, 1.0, 1.0])
    b = Sequence(tokens=[0, 1], weights=[0.0, 1.0])
    batch = pack_one([a, b])
    per_token = torch.tensor([1.0, 3.0, float("nan"), 5.0, 7.0])  # NaN/7 sit on ignored labels
    totals = normaliser_totals([batch], "token")
    assert totals == {"tokens": 5, "loss_tokens": 3, "sequences": 2, "loss_sequences": 2}
    assert float(reduce_loss(per_token, batch, "token", totals)) == pytest.approx(9 / 3)
    assert float(reduce_loss(per_token, batch, "sequence", totals)) == pytest.approx((2 + 5) / 2)
    assert float(reduce_loss(per_token, batch, "constant", totals, constant=10)) == pytest.approx(0.9)


def test_sequences_without_loss_tokens_do_not_dilute_sequence_mean():
    a = Sequence(tokens=[0, 1], weights=[0.0, 1.0])
    empty = Sequence(tokens=[0, 1, 2], weights=[0.0, 0.0, 0.0])
    batch = pack_one([a, empty])
    totals = normaliser_totals([batch], "sequence")
    assert totals["sequences"] == 2 and totals["loss_sequences"] == 1
    per_token = torch.tensor([4.0, 0.0, 0.0, 0.0, 0.0])
    assert float(reduce_loss(per_token, batch, "sequence", totals)) == pytest.approx(4.0)


def test_bad_normaliser_arguments():
    (batch,) = pack(_sequences(), token_budget=1000)
    with pytest.raises(ValueError, match="unknown normaliser 'tokens'"):
        normaliser_totals([batch], "tokens")
    totals = normaliser_totals([batch], "constant")
    with pytest.raises(ValueError, match="constant"):
        reduce_loss(torch.zeros(batch.n_tokens), batch, "constant", totals)
    with pytest.raises(ValueError, match="no micro-batches"):
        normaliser_totals([], "token")
    no_loss = pack_one([Sequence(tokens=[1, 2, 3], weights=[0.0, 0.0, 0.0])])
    with pytest.raises(ValueError, match="no loss tokens"):
        normaliser_totals([no_loss], "token")
    assert normaliser_totals([no_loss], "constant")["loss_tokens"] == 0
