"""Chunked per-token entropy: hand values, the full-softmax reference, and the training step's metric."""

from __future__ import annotations

import math

import pytest
import torch
from rlpipe.training.batch import Sequence, pack_one
from rlpipe.training.entropy import chunked_entropy
from rlpipe.training.losses import loss_token_mask
from rlpipe.training.rl_loss import build_rl_loss


def test_entropy_by_hand():
    w = torch.eye(4)  # logits = hidden
    hidden = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -50.0, -50.0]])
    h = chunked_entropy(hidden, w, chunk_size=2)
    # uniform over 4: log 4; one-hot: 0; p = (3/4, 1/4, ~0, ~0): −(¾ log ¾ + ¼ log ¼)
    expected = torch.tensor([math.log(4), 0.0, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))])
    torch.testing.assert_close(h, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_entropy_matches_full_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    hidden, w, b = torch.randn(37, 16, generator=g), torch.randn(50, 16, generator=g), torch.randn(50, generator=g)
    full = torch.distributions.Categorical(logits=(hidden @ w.t() + b) / temperature).entropy()
    torch.testing.assert_close(chunked_entropy(hidden, w, 8, temperature, b), full, atol=1e-5, rtol=1e-5)


def test_forward_backward_logs_mean_entropy_of_loss_tokens():
    from rlpipe.tasks.setup import make_model_and_tokenizer
    from rlpipe.training.logprobs import token_logprobs
    from rlpipe.training.step import StepOptions, forward_backward

    model, _ = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    batch = pack_one([Sequence(tokens=[5, 6, 7, 8, 9, 10], weights=[0, 0, 0, 1.0, 1.0, 1.0], sample_id="a"),
                      Sequence(tokens=[5, 6, 11, 12], weights=[0, 0, -1.0, -1.0], sample_id="b")])
    metrics = forward_backward(model, [batch], build_rl_loss("reinforce"), StepOptions(entropy=True, temperature=0.8))
    from rlpipe.models.attention import model_hidden_states

    with torch.no_grad():
        hidden, _ = model_hidden_states(model, batch)
        logits = model.get_output_embeddings()(hidden).float() / 0.8
        full = torch.distributions.Categorical(logits=logits).entropy()
    mask = loss_token_mask(batch)
    assert metrics["entropy"] == pytest.approx(float(full[mask].mean()), rel=1e-4)
    # the log-probs and gradients are those of the plain path
    model.zero_grad()
    plain = forward_backward(model, [batch], build_rl_loss("reinforce"), StepOptions(temperature=0.8))
    assert "entropy" not in plain and plain["loss"] == pytest.approx(metrics["loss"])
    assert token_logprobs(model, batch)[0].shape == (batch.n_tokens,)
