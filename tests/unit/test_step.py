"""The functional step: exact gradient accumulation, loud failures, optimizer and schedule."""

from __future__ import annotations

import math

import pytest
import torch
from rlpipe.models.loading import bf16_autocast_supported
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack, pack_one
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import (
    StepOptions,
    build_optimizer,
    build_scheduler,
    forward_backward,
    lr_factor,
    optim_step,
)

VOCAB = 48


def _sequences(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        length = int(torch.randint(4, 24, (1,), generator=g))
        toks = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        cut = int(torch.randint(1, length - 1, (1,), generator=g))
        weights = [0.0] * cut + [1.0 + 0.1 * i] * (length - cut)
        seqs.append(Sequence(tokens=toks, weights=weights, sample_id=f"s{i}"))
    return seqs


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normaliser", ["token", "sequence", "constant"])
def test_micro_batches_give_the_gradient_of_one_batch(normaliser):
    seqs = _sequences()
    micro = pack(seqs, token_budget=40)
    assert len(micro) >= 4
    model = build_model("tiny-dense", vocab_size=VOCAB, seed=3)

    m_one = forward_backward(model, [pack_one(seqs)], nll_loss, StepOptions(normaliser=normaliser, constant=256.0))
    one = _grads(model)
    model.zero_grad(set_to_none=True)
    m_many = forward_backward(model, micro, nll_loss, StepOptions(normaliser=normaliser, constant=256.0))
    many = _grads(model)

    assert one.keys() == many.keys() and len(one) > 0
    for name in one:
        torch.testing.assert_close(many[name], one[name], atol=1e-6, rtol=1e-4, msg=name)
    assert m_many["loss"] == pytest.approx(m_one["loss"], rel=1e-5)
    assert m_many["nll"] == pytest.approx(m_one["nll"], rel=1e-5)
    assert m_many["tokens"] == sum(len(s.tokens) for s in seqs)
    assert m_many["sequences"] == len(seqs)
    assert m_many["loss_tokens"] == sum(sum(1 for w in s.weights[1:] if w) for s in seqs)
    assert m_many["micro_batches"] == len(micro) and m_many["seconds"] > 0


def test_nan_loss_raises_and_clears_gradients():
    model = build_model("tiny-dense", vocab_size=VOCAB)
    micro = pack(_sequences(), token_budget=48)
    calls = []

    def nan_on_second(logprobs, batch):
        calls.append(1)
        per_token, metrics = nll_loss(logprobs, batch)
        if len(calls) == 2:
            per_token = per_token + float("nan")
        return per_token, metrics

    with pytest.raises(FloatingPointError, match="non-finite loss .* micro-batch 1"):
        forward_backward(model, micro, nan_on_second)
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_grad_norm_refuses_to_step():
    model = build_model("tiny-dense", vocab_size=VOCAB)
    opt = build_optimizer(model, lr=1e-2)
    forward_backward(model, pack(_sequences(), token_budget=256), nll_loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    next(model.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="gradient norm"):
        optim_step(model, opt, None, max_grad_norm=1.0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None


def test_optim_step_clips_steps_and_schedules():
    model = build_model("tiny-dense", vocab_size=VOCAB)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    forward_backward(model, pack(_sequences(), token_budget=256), nll_loss)
    metrics = optim_step(model, opt, sched, max_grad_norm=1e-3)
    assert metrics["lr"] == pytest.approx(1e-2 * 0.5)  # first warmup step: 1/2 of the peak
    assert metrics["grad_norm"] > 1e-3  # reported before clipping
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # scheduler advanced
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_schedule_warmup_then_cosine_to_min():
    f = [lr_factor(s, warmup_steps=4, total_steps=14, min_lr_ratio=0.1) for s in range(20)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0)
    assert f[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False))
    assert f[14] == pytest.approx(0.1) and f[19] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        build_scheduler(build_optimizer(build_model("tiny-dense", VOCAB), 1e-3), 1, 10, 1.5)


def test_no_weight_decay_on_norms_and_embeddings():
    model = build_model("tiny-dense", vocab_size=VOCAB, tie_word_embeddings=False)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "lm_head.weight" in names
    assert "model.embed_tokens.weight" not in names
    assert not any("norm" in n for n in names)
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))


def test_moe_adds_router_aux_loss():
    model = build_model("tiny-moe", vocab_size=VOCAB)
    batches = pack(_sequences(), token_budget=64)
    metrics = forward_backward(model, batches, nll_loss, StepOptions(aux_loss_coef=0.0))
    assert metrics["aux_loss"] > 0
    no_aux = _grads(model)
    model.zero_grad(set_to_none=True)
    forward_backward(model, batches, nll_loss, StepOptions(aux_loss_coef=1.0))
    with_aux = _grads(model)
    router = [n for n in no_aux if n.endswith("mlp.gate.weight")]
    assert router and any(not torch.allclose(no_aux[n], with_aux[n]) for n in router)


@pytest.mark.skipif(not bf16_autocast_supported(torch.device("cpu")), reason="no bf16 on this CPU")
def test_autocast_step_is_close_to_fp32():
    model = build_model("tiny-dense", vocab_size=VOCAB)
    batches = pack(_sequences(), token_budget=64)
    fp32 = forward_backward(model, batches, nll_loss)
    model.zero_grad(set_to_none=True)
    bf16 = forward_backward(model, batches, nll_loss, StepOptions(autocast=True))
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.02)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
