"""Sequence-level masking of off-policy samples and the mismatch metrics."""

from __future__ import annotations

import pytest
import torch
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.off_policy import with_sequence_mask
from rlpipe.training.rl_loss import build_rl_loss


def two_sequences(engine_shift: float):
    """Two 2+3-token sequences; the second's engine log-probs are off by `engine_shift`."""
    seqs = [Sequence(tokens=[5, 6, 7, 8, 9], weights=[0, 0, 1, 1, 1], logprobs=[0, 0, -1, -1, -1],
                     reward=1.0, sample_id="a", loss_mask=[False, False, True, True, True]),
            Sequence(tokens=[5, 6, 7, 8, 9], weights=[0, 0, 1, 1, 1],
                     logprobs=[0, 0, -1 - engine_shift, -1 - engine_shift, -1 - engine_shift],
                     reward=1.0, sample_id="b", loss_mask=[False, False, True, True, True])]
    (batch,) = pack(seqs, 64)
    return batch


def test_sequence_far_off_policy_is_masked_and_metrics_are_reported():
    batch = two_sequences(engine_shift=2.0)
    trainer = batch.log_probs.clone()  # the trainer agrees with the engine on sequence a
    trainer[batch.log_probs < -2] = -1.0  # and differs by 2 nats a token on sequence b
    loss_fn = with_sequence_mask(build_rl_loss("reinforce"), max_log_ratio=0.5)
    per_token, metrics = loss_fn(trainer, batch)
    plain, _ = build_rl_loss("reinforce")(trainer, batch)
    seq_b = batch.log_probs < -2
    assert torch.all(per_token[seq_b] == 0) and torch.any(plain[seq_b] != 0)
    assert torch.equal(per_token[~seq_b], plain[~seq_b])
    assert metrics["seq_mask_fraction"] == pytest.approx(0.5)
    assert metrics["mismatch_kl"] > 0


def test_no_mask_when_off_and_zero_kl_on_policy():
    batch = two_sequences(engine_shift=0.0)
    per_token, metrics = with_sequence_mask(build_rl_loss("reinforce"))(batch.log_probs.clone(), batch)
    assert metrics["seq_mask_fraction"] == 0 and metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert torch.equal(per_token, build_rl_loss("reinforce")(batch.log_probs.clone(), batch)[0])
