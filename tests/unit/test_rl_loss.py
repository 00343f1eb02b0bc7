"""REINFORCE, PPO-clip and truncated importance weights in the loss_fn shape."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.loss_inputs import bind_old_logprobs
from rlpipe.training.losses import normaliser_totals, reduce_loss
from rlpipe.training.rl_loss import (
    RLLossOptions,
    build_rl_loss,
    ppo_clip_loss,
    reinforce_loss,
)


def _batch(advantages=(1.0, -0.5), engine=((-1.0, -2.0), (-0.5, -0.25))):
    """Two sequences: 3 prompt tokens + 2 completion tokens each; loss tokens at 2, 3, 7, 8."""
    seqs = [
        Sequence(
            tokens=[1, 2, 3, 4 + i, 5 + i],
            weights=[0.0, 0.0, 0.0, a, a],
            logprobs=[0.0, 0.0, 0.0, *lp],
            reward=a,
            sample_id=f"s{i}",
        )
        for i, (a, lp) in enumerate(zip(advantages, engine, strict=True))
    ]
    return pack_one(seqs)


LOSS_POSITIONS = [2, 3, 7, 8]


def test_reinforce_per_token_is_minus_advantage_times_logprob():
    batch = _batch()
    logprobs = torch.tensor([-9.0, -9.0, -1.5, -2.5, -9.0, -9.0, -9.0, -0.5, -1.0, -9.0])
    per_token, metrics = reinforce_loss(logprobs, batch)
    expected = torch.zeros(10)
    expected[[2, 3]] = torch.tensor([1.5, 2.5])  # −(1.0)·logp
    expected[[7, 8]] = torch.tensor([-0.25, -0.5])  # −(−0.5)·logp
    torch.testing.assert_close(per_token, expected)
    # |trainer − engine| on loss tokens: 0.5, 0.5, 0, 0.75
    assert metrics["logprob_gap"] == pytest.approx((0.5 + 0.5 + 0.0 + 0.75) / 4)
    assert "clip_fraction" not in metrics


def _param_logprobs(batch, vocab=12, seed=0):
    torch.manual_seed(seed)
    logits = torch.randn(batch.n_tokens, vocab, requires_grad=True)
    labels = batch.labels.clamp(min=0)

    def logprobs():
        lp = torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)
        return torch.where(batch.labels != -100, lp, torch.zeros_like(lp))

    return logits, logprobs


@pytest.mark.parametrize("name", ["reinforce", "ppo_clip"])
def test_gradient_step_raises_logprob_of_positive_and_lowers_negative(name):
    batch = _batch(advantages=(1.0, -1.0))
    logits, logprobs = _param_logprobs(batch)
    with torch.no_grad():
        batch.log_probs = logprobs().clone()  # on-policy: engine = trainer
    loss_fn = build_rl_loss(name)
    before = logprobs().detach()
    per_token, _ = loss_fn(logprobs(), batch)
    per_token.sum().backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad
    delta = logprobs().detach() - before
    assert (delta[[2, 3]] > 0).all()  # advantage +1: more likely
    assert (delta[[7, 8]] < 0).all()  # advantage −1: less likely


def test_ppo_first_step_ratio_is_exactly_one():
    batch = _batch()
    logprobs = batch.log_probs.clone().requires_grad_(True)
    per_token, metrics = ppo_clip_loss(logprobs, batch)
    assert metrics["ratio_mean"] == 1.0
    assert metrics["clip_fraction"] == 0.0
    assert metrics["logprob_gap"] == 0.0
    # at r = 1 PPO equals REINFORCE in value and gradient
    ref_lp = batch.log_probs.clone().requires_grad_(True)
    ref, _ = reinforce_loss(ref_lp, batch)
    per_token.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logprobs.grad, ref_lp.grad)


def test_ppo_asymmetric_clip_hand_computed():
    cfg = RLLossOptions(name="ppo_clip", epsilon_low=0.2, epsilon_high=0.28)
    batch = _batch(advantages=(1.0, -1.0), engine=((0.0, 0.0), (0.0, 0.0)))
    batch.log_probs = torch.zeros(10)
    ratios = {2: 1.25, 3: 1.40, 7: 0.85, 8: 0.70}  # A>0: in, clipped; A<0: in, clipped
    lp = torch.zeros(10)
    for t, r in ratios.items():
        lp[t] = math.log(r)
    lp.requires_grad_(True)
    per_token, metrics = ppo_clip_loss(lp, batch, config=cfg)
    assert per_token[2].item() == pytest.approx(-1.25)
    assert per_token[3].item() == pytest.approx(-1.28)  # clipped at 1 + ε_high
    assert per_token[7].item() == pytest.approx(0.85)
    assert per_token[8].item() == pytest.approx(0.80)  # clipped at 1 − ε_low
    assert metrics["clip_fraction"] == 0.5
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios.values()) / 4)
    per_token.sum().backward()
    assert lp.grad[3] == 0 and lp.grad[8] == 0  # clipped: no gradient
    assert lp.grad[2] == pytest.approx(-1.25) and lp.grad[7] == pytest.approx(0.85)
    # a negative advantage with a large ratio is not clipped (pessimistic bound)
    lp2 = torch.zeros(10)
    lp2[7] = math.log(1.5)
    per_token2, m2 = ppo_clip_loss(lp2, batch, config=cfg)
    assert per_token2[7].item() == pytest.approx(1.5) and m2["clip_fraction"] == 0.0


def test_truncated_importance_weights_are_detached_and_capped():
    batch = _batch(advantages=(1.0, 1.0), engine=((-1.0, -1.0), (-1.0, -1.0)))
    old = torch.zeros(10)
    old[[2, 3, 7, 8]] = torch.tensor([-1.0, -0.5, -3.0, 1.0])  # weights 1, e^0.5, e^-2, e^2→cap
    loss_fn = build_rl_loss("reinforce", tis_cap=2.0)
    lp = torch.full((10,), -1.0, requires_grad=True)
    per_token, metrics = loss_fn(lp, batch, old_logprobs=old)
    w = torch.tensor([1.0, math.exp(0.5), math.exp(-2.0), 2.0])
    torch.testing.assert_close(per_token[LOSS_POSITIONS], w * 1.0)  # −A·logp = 1 per token
    per_token.sum().backward()
    torch.testing.assert_close(lp.grad[LOSS_POSITIONS], -w)  # weight is a constant
    assert metrics["tis_clip_fraction"] == 0.25
    assert metrics["tis_weight_mean"] == pytest.approx(float(w.mean()))
    # without old_logprobs the current (on-policy) log-probs stand in for the old trainer's
    per_token_on, _ = loss_fn(lp.detach(), batch)
    torch.testing.assert_close(per_token_on[LOSS_POSITIONS], torch.ones(4))


def test_ppo_with_tis_needs_old_logprobs_and_bind_helper():
    batch = _batch()
    loss_fn = build_rl_loss("ppo_clip", tis_cap=2.0)
    with pytest.raises(ValueError, match="old_logprobs"):
        loss_fn(batch.log_probs.clone(), batch)
    bound = bind_old_logprobs(loss_fn, [batch], [batch.log_probs.clone()])
    per_token, metrics = bound(batch.log_probs.clone(), batch.to("cpu"))
    assert metrics["ratio_mean"] == 1.0 and metrics["tis_weight_mean"] == 1.0
    with pytest.raises(ValueError, match="no old_logprobs bound"):
        bound(batch.log_probs.clone(), dataclasses.replace(batch, sample_ids=["x", "y"]))


def test_build_rl_loss_validates():
    with pytest.raises(ValueError, match="unknown RL loss 'grpo'"):
        build_rl_loss("grpo")
    with pytest.raises(ValueError, match="clip_eps"):
        build_rl_loss("ppo_clip", clip_eps=0.2)
    with pytest.raises(ValueError, match="epsilon_low"):
        build_rl_loss("ppo_clip", epsilon_low=1.5)
    batch = _batch()
    batch.log_probs = None
    with pytest.raises(ValueError, match="log_probs"):
        build_rl_loss("ppo_clip")(torch.zeros(10), batch)
    per_token, metrics = build_rl_loss("reinforce")(torch.zeros(10), batch)
    assert metrics == {} and per_token.abs().sum() == 0


def test_extreme_ratio_stays_finite_through_reduce_loss():
    batch = _batch(advantages=(1.0, -1.0))
    lp = torch.full((10,), 0.0)
    lp[7] = 500.0  # absurd trainer log-prob: the clamp keeps exp finite
    lp.requires_grad_(True)
    per_token, _ = build_rl_loss("ppo_clip")(lp, batch)
    loss = reduce_loss(per_token, batch, "token", normaliser_totals([batch], "token"))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
