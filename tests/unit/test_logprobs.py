"""Chunked selective log-softmax equals full log_softmax + gather, in values and gradients."""

from __future__ import annotations

import pytest
import torch
from rlpipe.models.attention import packed_logits
from rlpipe.models.loading import bf16_autocast_supported
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.logprobs import selective_log_softmax, token_logprobs


def _full(hidden, weight, labels, temperature=1.0, bias=None):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    valid = labels != -100
    picked = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def _inputs(T=53, H=24, V=97, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5
    bias = torch.randn(V, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::7] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_equals_full_values_and_grads(chunk_size, temperature, with_bias):
    hidden, weight, bias, labels = _inputs()
    bias = bias if with_bias else None
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)] + (
        [bias.clone().requires_grad_()] if with_bias else []
    )
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    out = selective_log_softmax(
        leaves[0], leaves[1], labels, chunk_size, temperature, leaves[2] if with_bias else None
    )
    ref = _full(refs[0], refs[1], labels, temperature, refs[2] if with_bias else None)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.all(out[labels == -100] == 0)
    # A non-uniform upstream gradient, as a weighted loss gives.
    upstream = torch.linspace(-1.0, 2.0, labels.numel())
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for a, b in zip(leaves, refs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64():
    hidden, weight, bias, labels = _inputs(T=11, H=5, V=13, dtype=torch.float64)
    args = [t.requires_grad_() for t in (hidden, weight, bias)]

    def fn(h, w, b):
        return selective_log_softmax(h, w, labels, chunk_size=4, temperature=0.9, lm_head_bias=b)

    assert torch.autograd.gradcheck(fn, args)


def test_no_grad_for_frozen_weight():
    hidden, weight, _, labels = _inputs()
    hidden.requires_grad_()
    selective_log_softmax(hidden, weight, labels, chunk_size=10).sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.skipif(not bf16_autocast_supported(torch.device("cpu")), reason="no bf16 on this CPU")
def test_autocast_bf16_is_close_and_float32():
    hidden, weight, _, labels = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = selective_log_softmax(h, w, labels, chunk_size=16)
    assert out.dtype == torch.float32
    # bf16 autocast rounds the inputs and the logits to 8 significant bits (u = 2^-8): against the
    # float32 computation from the rounded inputs, a log-prob (logit − logsumexp) is off by at most
    # ~2u·max|logit|. A temperature of 0.95 instead of 1.0 is off by ~5% of a log-prob: refused.
    rounded = hidden.bfloat16().float(), weight.bfloat16().float()
    atol = 2 * 2.0**-8 * (rounded[0] @ rounded[1].t()).abs().max().item()
    torch.testing.assert_close(out, _full(*rounded, labels), atol=atol, rtol=0)
    assert (_full(*rounded, labels, temperature=0.95) - out).abs().max().item() > 2 * atol
    out.sum().backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_rejects_bad_shapes():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="hidden size"):
        selective_log_softmax(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="labels"):
        selective_log_softmax(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(hidden, weight, labels, temperature=0.0)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in (9, 17, 5, 12):
        toks = torch.randint(0, vocab, (n,), generator=g).tolist()
        seqs.append(Sequence(tokens=toks, weights=[1.0] * n))
    (batch,) = pack(seqs, token_budget=64)
    return batch


@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_matches_model_logits(tied):
    model = build_model("tiny-dense", vocab_size=40, tie_word_embeddings=tied)
    batch = _batch(40)
    lp, aux = token_logprobs(model, batch, chunk_size=7)
    assert aux is None
    logits = packed_logits(model, batch)
    ref = _full_from_logits(logits, batch.labels)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    # Gradients through the whole model agree too.
    lp.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _full_from_logits(packed_logits(model, batch), batch.labels).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def _full_from_logits(logits, labels):
    logp = torch.log_softmax(logits.float(), -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels != -100, logp, torch.zeros_like(logp))


def test_token_logprobs_moe_returns_aux_loss():
    model = build_model("tiny-moe", vocab_size=40)
    lp, aux = token_logprobs(model, _batch(40))
    assert aux is not None and aux.dim() == 0 and torch.isfinite(aux)
    assert torch.isfinite(lp).all() and (lp <= 0).all()
