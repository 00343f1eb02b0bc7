"""GSPO, CISPO, Dr. GRPO and the KL penalty, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.kl import frozen_copy, kl_estimate, reference_logprobs
from rlpipe.training.loss_inputs import bind_batch_inputs
from rlpipe.training.losses import normaliser_totals, reduce_loss
from rlpipe.training.rl_loss import (
    RLLossOptions,
    build_rl_loss,
    cispo_loss,
    gspo_loss,
    loss_normaliser,
    ppo_clip_loss,
)


def _batch(advantages=(1.0, -1.0), completion=(2, 2)):
    """Sequences of 3 prompt tokens + `completion[i]` tokens, engine log-probs 0 everywhere."""
    seqs = []
    for i, (a, n) in enumerate(zip(advantages, completion, strict=True)):
        seqs.append(Sequence(tokens=[1, 2, 3] + [4 + i] * n, weights=[0.0] * 3 + [a] * n,
                             logprobs=[0.0] * (3 + n), sample_id=f"s{i}"))
    return pack_one(seqs)


def _logprobs(values: dict[int, float], n: int = 10) -> torch.Tensor:
    lp = torch.zeros(n)
    for t, v in values.items():
        lp[t] = v
    return lp.requires_grad_(True)


def test_gspo_sequence_ratio_and_clip_by_hand():
    batch = _batch()  # loss tokens 2, 3 (A = +1) and 7, 8 (A = −1)
    lp = _logprobs({2: math.log(1.1), 3: math.log(1.3), 7: math.log(0.5), 8: math.log(0.8)})
    per_token, metrics = gspo_loss(lp, batch)  # ε = 0.2 / 0.28
    s0, s1 = math.sqrt(1.1 * 1.3), math.sqrt(0.5 * 0.8)  # exp of the mean log-ratio
    assert per_token[2].item() == pytest.approx(-s0) and per_token[3].item() == pytest.approx(-s0)
    # A < 0 and s1 = 0.632 < 1 − 0.2: the clipped branch, −min(−s1, −0.8) = 0.8, no gradient
    assert per_token[7].item() == pytest.approx(0.8) and per_token[8].item() == pytest.approx(0.8)
    assert metrics["clip_fraction"] == 0.5
    assert metrics["ratio_mean"] == pytest.approx((s0 + s1) / 2)
    per_token.sum().backward()
    # d(−s0)/d lp_t summed over the sequence's two tokens: −2 · s0 · 1/2 each
    assert lp.grad[2].item() == pytest.approx(-s0) and lp.grad[3].item() == pytest.approx(-s0)
    assert lp.grad[7] == 0 and lp.grad[8] == 0
    assert lp.grad[[0, 1, 4, 5, 6, 9]].abs().sum() == 0


def test_gspo_on_policy_equals_sequence_mean_reinforce_gradient():
    batch = _batch(advantages=(0.5, -1.5), completion=(2, 3))
    lp = torch.randn(batch.n_tokens, generator=torch.Generator().manual_seed(0))
    batch.log_probs = lp.clone()
    a = lp.clone().requires_grad_(True)
    per_token = gspo_loss(a, batch)[0]
    reduce_loss(per_token, batch, "sequence", normaliser_totals([batch], "sequence")).backward()
    # at s = 1 the sequence's loss −s·A has ∂/∂lp_t = −A/|y|: REINFORCE with a per-sequence mean
    # (then ÷ 2 sequences)
    lengths = {2: 2, 3: 2, 7: 3, 8: 3, 9: 3}  # loss positions → their sequence's completion length
    for t in range(batch.n_tokens):
        want = -float(batch.token_weights[t]) / lengths[t] / 2 if t in lengths else 0.0
        assert a.grad[t].item() == pytest.approx(want), t


def test_cispo_truncated_detached_weight_by_hand():
    batch = _batch()
    lp = _logprobs({2: math.log(2.0), 3: math.log(8.0), 7: math.log(0.5), 8: 0.0})
    values = lp.detach().clone()
    per_token, metrics = cispo_loss(lp, batch, config=RLLossOptions(name="cispo", cispo_cap=5.0))
    w = {2: 2.0, 3: 5.0, 7: 0.5, 8: 1.0}  # ratio 8 truncated at the cap
    adv = {2: 1.0, 3: 1.0, 7: -1.0, 8: -1.0}
    for t in w:
        assert per_token[t].item() == pytest.approx(-w[t] * adv[t] * values[t].item())
    assert metrics["clip_fraction"] == 0.25
    assert metrics["ratio_mean"] == pytest.approx((2 + 8 + 0.5 + 1) / 4)
    per_token.sum().backward()
    for t in w:  # the weight is a constant: every token keeps a gradient, even the capped one
        assert lp.grad[t].item() == pytest.approx(-w[t] * adv[t])


def test_dr_grpo_is_ppo_clip_normalised_by_a_constant():
    batch = _batch(advantages=(1.0, 1.0), completion=(2, 4))
    lp = torch.zeros(batch.n_tokens, requires_grad=True)
    per_token, _ = build_rl_loss("dr_grpo")(lp, batch)
    torch.testing.assert_close(per_token, ppo_clip_loss(lp, batch)[0])
    mode, constant = loss_normaliser("dr_grpo", "token", sequences_per_step=2, max_new_tokens=8)
    assert (mode, constant) == ("constant", 16.0)
    reduce_loss(per_token, batch, mode, normaliser_totals([batch], mode), constant).backward(retain_graph=True)
    grads = lp.grad[batch.token_weights != 0]
    assert grads.numel() == 6
    # no length normalisation: every completion token of both sequences gets −A/16
    torch.testing.assert_close(grads, torch.full_like(grads, -1 / 16))
    # GRPO's per-sequence mean would give the short sequence's tokens twice the long one's
    lp.grad = None
    reduce_loss(per_token, batch, "sequence", normaliser_totals([batch], "sequence")).backward()
    assert lp.grad[3].item() == pytest.approx(2 * lp.grad[8].item())
    assert loss_normaliser("gspo", "token", 2, 8)[0] == "sequence"
    assert loss_normaliser("cispo", "token", 2, 8)[0] == "token"


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([0.125, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.tensor([math.exp(-0.5) - 0.5, 0.0]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_kl_penalty_in_the_loss_needs_bound_reference():
    batch = _batch()
    loss_fn = build_rl_loss("reinforce", kl_coef=0.1, kl_estimator="k3")
    lp = _logprobs({2: -1.0, 3: -1.0, 7: -1.0, 8: -1.0})
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_fn(lp, batch)
    ref = torch.full((10,), -1.5)
    bound = bind_batch_inputs(loss_fn, [batch], ref_logprobs=[ref])
    per_token, metrics = bound(lp, batch)
    k3 = math.exp(-0.5) - 0.5
    assert per_token[2].item() == pytest.approx(1.0 + 0.1 * k3)  # −A·lp + β·k3, A = +1
    assert per_token[7].item() == pytest.approx(-1.0 + 0.1 * k3)  # A = −1
    assert per_token[0].item() == 0.0  # a prompt token carries no KL
    assert metrics["kl"] == pytest.approx(k3)
    per_token.sum().backward()
    # d k3 / d lp = 1 − exp(ref − lp)
    assert lp.grad[2].item() == pytest.approx(-1.0 + 0.1 * (1 - math.exp(-0.5)))
    with pytest.raises(ValueError, match="kl_coef"):
        build_rl_loss("reinforce", kl_coef=-1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        build_rl_loss("gspo", tis_cap=2.0)


def test_reference_is_the_frozen_start():
    from rlpipe.tasks.setup import make_model_and_tokenizer
    from rlpipe.training.step import build_optimizer, forward_backward, optim_step

    model, _ = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    ref = frozen_copy(model)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    seqs = [Sequence(tokens=[5, 6, 7, 8, 9], weights=[0, 0, 1.0, 1.0, 1.0], sample_id="a")]
    batch = pack_one(seqs)
    before = reference_logprobs(ref, [batch])[0]
    optimizer = build_optimizer(model, lr=1e-2)
    forward_backward(model, [batch], build_rl_loss("reinforce"))
    optim_step(model, optimizer)
    from rlpipe.training.logprobs import token_logprobs

    with torch.no_grad():
        now = token_logprobs(model.eval(), batch)[0]
    torch.testing.assert_close(reference_logprobs(ref, [batch])[0], before)  # unchanged
    assert (now - before)[2:4].abs().max() > 1e-4  # while the policy moved
