"""Next-token sampling from a batch of logits: temperature, top-k, top-p, greedy.

Randomness comes in as one uniform number per row (drawn by the caller from a seeded
`torch.Generator`), and a token is drawn by inverting the cumulative distribution. So a
sequence's draws depend only on the seed and its own row, not on which other rows are still
in the batch, and sampling costs a cumsum and a search rather than a multinomial per row.
"""

from __future__ import annotations

import torch
from rlpipe.engines.base import SamplingParams


def sample_next(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    logits: [B, V] (any float dtype); uniforms: [B] in [0, 1) (unused when greedy).
    Returns tokens int64 [B] and their log-probs float32 [B] under the tempered, untruncated
    distribution (temperature 1 when greedy).
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
    assert uniforms is not None
    scaled = logits if params.temperature == 1.0 else logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if params.top_k > 0 or params.top_p < 1.0:
        tokens = _sample_truncated(probs, params.top_k, params.top_p, uniforms)
    else:
        tokens = _invert_cdf(probs, uniforms)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def kept_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens top-k then top-p may draw from. probs: [B, V] -> bool [B, V].

    top-k keeps the k most likely tokens; top-p then keeps, from those (renormalised), the
    smallest most-likely-first prefix whose mass reaches top_p. At least one token is kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep_sorted = _kept_sorted(sorted_probs, top_k, top_p)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _kept_sorted(sorted_probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """sorted_probs: [B, V] descending -> bool [B, V] in the same sorted order."""
    vocab = sorted_probs.shape[-1]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[:, top_k:] = False
    if top_p < 1.0:
        kept = sorted_probs * keep
        mass_before = kept.cumsum(dim=-1) - kept
        # mass_before < top_p * total keeps the shortest prefix reaching top_p (first always kept)
        keep &= mass_before < top_p * kept.sum(dim=-1, keepdim=True)
    return keep


def _sample_truncated(
    probs: torch.Tensor, top_k: int, top_p: float, uniforms: torch.Tensor
) -> torch.Tensor:
    """probs: [B, V]; returns int64 [B] drawn from the kept tokens, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = _kept_sorted(sorted_probs, top_k, top_p)
    picked = _invert_cdf(sorted_probs * keep, uniforms)
    return order.gather(1, picked[:, None]).squeeze(1)


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index i with cdf[i] >= u * total. weights: [B, V] >= 0; uniforms: [B] in [0, 1).

    cdf[i-1] < target <= cdf[i] means weights[i] > 0, so a zero-weight token is never drawn
    (the target is kept above 0 for the same reason); u < 1 keeps the index below V.
    """
    cdf = weights.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]).clamp_(min=torch.finfo(cdf.dtype).tiny)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=weights.shape[-1] - 1)
