"""SamplingParams validation and the sampler (inverse-CDF draws, truncation, greedy)."""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines.base import Completion, SamplingParams
from rlpipe.engines.sampling import kept_mask, sample_next


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("stop_token_ids", (1, -2)),
        ("stop_token_ids", ("a",)),
        ("seed", -1),
        ("greedy", 1),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_list_stop_ids():
    params = SamplingParams(stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4)
    assert SamplingParams().n == 1 and SamplingParams().top_k == 0


def test_completion_checks_lengths_and_reason():
    with pytest.raises(ValueError, match="logprobs"):
        Completion(tokens=[1, 2], logprobs=[0.0])
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(tokens=[1], logprobs=[0.0], finish_reason="eos")  # type: ignore[arg-type]


def _stratified(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + 0.5) / n


def test_inverse_cdf_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5]])
    n = 20_000
    params = SamplingParams(temperature=0.7)
    tokens, logprobs = sample_next(logits.expand(n, -1), params, _stratified(n))
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq - probs).abs().max().item() < 2e-3
    expected = torch.log_softmax(logits[0] / 0.7, dim=-1)[tokens]
    assert torch.allclose(logprobs, expected)


def test_zero_probability_tokens_are_never_drawn_even_at_the_extremes():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]])
    uniforms = torch.tensor([0.0, 1e-9, 0.5, 1.0 - 2**-24])
    tokens, _ = sample_next(logits.expand(4, -1), SamplingParams(), uniforms)
    assert set(tokens.tolist()) <= {1, 3}
    tokens, _ = sample_next(logits.expand(4, -1), SamplingParams(top_k=1), uniforms)
    assert tokens.tolist() == [3, 3, 3, 3]


def test_kept_mask_top_k_and_top_p():
    probs = torch.tensor([[0.05, 0.4, 0.3, 0.2, 0.05]])
    assert kept_mask(probs, top_k=2, top_p=1.0).tolist() == [[False, True, True, False, False]]
    # 0.4 + 0.3 = 0.7 < 0.75, so 0.2 is needed too
    assert kept_mask(probs, top_k=0, top_p=0.75).tolist() == [[False, True, True, True, False]]
    # top-p on the renormalised top-2: 0.4 / 0.7 = 0.57 reaches 0.5
    assert kept_mask(probs, top_k=2, top_p=0.5).tolist() == [[False, True, False, False, False]]
    assert kept_mask(probs, top_k=0, top_p=1e-6).sum().item() == 1


def test_truncated_sampling_stays_in_the_kept_set_and_covers_it():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    n = 5_000
    params = SamplingParams(top_k=10, top_p=0.7)
    tokens, logprobs = sample_next(logits.expand(n, -1), params, _stratified(n))
    kept = kept_mask(torch.softmax(logits, -1), 10, 0.7)[0]
    drawn = torch.zeros(50, dtype=torch.bool)
    drawn[tokens] = True
    assert torch.equal(drawn, kept)
    # untruncated log-probs are reported, not the renormalised ones
    assert torch.allclose(logprobs, torch.log_softmax(logits[0], -1)[tokens])


def test_greedy_is_argmax_with_temperature_one_logprobs():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample_next(logits, SamplingParams(greedy=True, temperature=0.3), None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)
