"""Off-policy diagnostics and sequence-level masking for async RL, around any RL loss.

With `rl.off_policy.max_steps >= 1` a batch was sampled by weights up to k updates older than the
ones being trained (the behaviour policy, whose log-probs the engine recorded). Per token,
log r = trainer log-prob − behaviour log-prob. This wrapper

- masks whole sequences whose mean log r over their completion tokens exceeds `max_log_ratio` in
  absolute value (the geometric-mean ratio leaves [e^-t, e^t]; as TRL's `sequence_mask` / verl's
  rollout correction: a sequence the trainer no longer recognises carries a biased gradient);
  0 = no masking, metrics only;
- reports `mismatch_kl` (the k3 estimator r − 1 − log r of KL(behaviour ‖ trainer), mean over loss
  tokens) and `seq_mask_fraction` (share of sequences masked).

The per-token importance weights themselves are the loss's `tis_cap` (training/rl_loss.py).

    loss_fn = with_sequence_mask(build_rl_loss("reinforce", tis_cap=2.0), max_log_ratio=0.5)
"""

from __future__ import annotations

import torch
from rlpipe.training.batch import PackedBatch
from rlpipe.training.losses import LossFn, loss_token_mask, sequence_index


def with_sequence_mask(loss_fn: LossFn, max_log_ratio: float = 0.0) -> LossFn:
    """`loss_fn` with whole off-policy sequences masked (see the module docstring)."""
    if max_log_ratio < 0:
        raise ValueError(f"max_log_ratio must be >= 0 (0 = off), got {max_log_ratio}")

    def masked(logprobs: torch.Tensor, batch: PackedBatch, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
        per_token, metrics = loss_fn(logprobs, batch, **kwargs)
        if batch.log_probs is None:
            return per_token, metrics
        mask = loss_token_mask(batch).to(logprobs.device)
        log_ratio = torch.where(mask, logprobs.detach() - batch.log_probs.to(logprobs), 0.0)
        seq = sequence_index(batch).to(logprobs.device)
        n = int(batch.cu_seqlens.numel()) - 1
        sums = torch.zeros(n, device=logprobs.device).index_add_(0, seq, log_ratio.float())
        counts = torch.zeros(n, device=logprobs.device).index_add_(0, seq, mask.float())
        scored = counts > 0
        off = scored & ((sums / counts.clamp(min=1)).abs() > max_log_ratio) if max_log_ratio > 0 \
            else torch.zeros_like(scored)
        per_token = torch.where(off[seq], torch.zeros_like(per_token), per_token)
        k3 = torch.exp(log_ratio.clamp(max=20.0)) - 1.0 - log_ratio
        tokens = max(int(mask.sum()), 1)
        metrics = {**metrics, "mismatch_kl": float(k3[mask].sum()) / tokens,
                   "seq_mask_fraction": float(off.sum()) / max(int(scored.sum()), 1)}
        return per_token, metrics

    return masked
