"""KL to a reference policy: per-token estimators and the reference log-probs.

With r = log π_ref(y_t) − log π_θ(y_t) on a token y_t sampled from π_θ (Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):

    k1 = −r                    unbiased, high variance, negative on some tokens
    k2 = r² / 2                biased, low variance, ≥ 0 (verl `kl_penalty="mse"`)
    k3 = exp(r) − r − 1        unbiased, low variance, ≥ 0 (TRL GRPOTrainer's `per_token_kl`,
                               verl `low_var_kl`; DeepSeekMath's GRPO)

The penalty enters the per-token loss as `kl_coef · k(logprobs, ref)` on loss tokens, with the
gradient flowing through the trainer's log-probs only (training/rl_loss.py applies it).

The reference is the policy the run started from: `frozen_copy(model)` taken before any update
(and before a resume loads later weights), evaluated once per batch by `reference_logprobs`,
under no_grad, with the same chunked log-softmax as training (never a [T, V] tensor).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from rlpipe.models.loading import autocast_context
from rlpipe.training.batch import PackedBatch
from rlpipe.training.logprobs import token_logprobs
from rlpipe.training.loss_choice import KL_ESTIMATORS  # noqa: F401 - kept without torch, for the config

_MAX_LOG_RATIO = 20.0  # exp(±20) stays finite in float32


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from log-probs [T] of the sampled tokens → [T]."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    r = (ref_logprobs.to(logprobs.dtype) - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    return torch.exp(r) - r - 1.0


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` in eval mode with every parameter frozen: the reference policy."""
    ref = copy.deepcopy(model).eval()
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref


@torch.no_grad()
def reference_logprobs(
    ref_model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    *,
    temperature: float = 1.0,
    autocast: bool = False,
    chunk_size: int = 1024,
) -> list[torch.Tensor]:
    """The reference policy's log-probs of every micro-batch's labels, float32 [T] each (on CPU)."""
    device = next(ref_model.parameters()).device
    out = []
    for batch in batches:
        with autocast_context(device, autocast):
            logprobs, _ = token_logprobs(ref_model, batch.to(device), temperature=temperature,
                                         chunk_size=chunk_size)
        out.append(logprobs.float().cpu())
    return out
