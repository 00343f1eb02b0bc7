"""Policy-gradient losses in the loss_fn shape: `loss_fn(logprobs [T], batch) -> (per_token [T], metrics)`.

The advantage arrives as the token weight (RL packing puts each sequence's advantage on its
completion tokens and 0 on prompt tokens), so the losses never see groups or rewards. They return
UNNORMALISED per-token losses; `training.losses.reduce_loss` normalises over the optimizer step.

Three log-probs of the same label tokens appear here; keep them apart:

    logprobs       [T]  the trainer's, under the weights being updated (carries the gradient)
    batch.log_probs [T] the engine's (generator's), recorded when the completion was sampled
    old_logprobs   [T]  the trainer's under the weights that sampled the batch, no gradient
                        (optional; on the first update of an on-policy batch = logprobs.detach())

Losses (`build_rl_loss(name, **options)`):

- `reinforce` (default): on-policy REINFORCE with the group baseline already in the advantage:
  per_token = −A · logprobs. No ratio, no clip, no KL. With a group baseline this is what
  "GRPO" reduces to when each batch gets one optimizer step.
- `ppo_clip`: r = exp(logprobs − old), per_token = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), for
  several optimizer steps per rollout batch. `old` = old_logprobs when given, else the engine's
  batch.log_probs (then the ratio also absorbs engine/trainer mismatch). Log-ratios are clamped
  to ±20 so that a wild token cannot produce inf.
- Truncated importance sampling (`tis_cap` > 0, either loss): multiply by the detached weight
  min(exp(old_trainer − engine), tis_cap), correcting for the engine sampling from a slightly
  different distribution than the trainer computes (other kernels, bf16). For `reinforce`,
  old_trainer = old_logprobs or logprobs.detach(); `ppo_clip` needs old_logprobs for it (else
  the weight would double-count the mismatch already in its ratio).

Metrics (means over this micro-batch's loss tokens, `training.losses.loss_token_mask`):
`logprob_gap` = mean |trainer − engine| log-prob, `ratio_mean`, `clip_fraction` (ppo_clip: share of
tokens whose clipped branch is active), `tis_weight_mean` and `tis_clip_fraction` (with tis_cap).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from training.batch import PackedBatch
from training.losses import LossFn, loss_token_mask

LOSSES = ("reinforce", "ppo_clip")
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, kw_only=True)
class RLLossConfig:
    """Options of the policy loss (rl.loss, rl.epsilon_low, ... in a run config)."""

    name: Literal["reinforce", "ppo_clip"] = "reinforce"
    """Which loss."""
    epsilon_low: float = 0.2
    """PPO: the ratio is clipped below at 1 − epsilon_low."""
    epsilon_high: float = 0.28
    """PPO: the ratio is clipped above at 1 + epsilon_high (asymmetric, 'clip-higher')."""
    tis_cap: float = 0.0
    """Truncated importance weight cap C for engine/trainer mismatch (0 = off)."""

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"unknown RL loss {self.name!r}; known: {', '.join(LOSSES)}")
        if not 0 <= self.epsilon_low < 1:
            raise ValueError(f"epsilon_low must be in [0, 1), got {self.epsilon_low}")
        if self.epsilon_high < 0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.tis_cap < 0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")


def _loss_mask(batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """bool [T]: the loss tokens (see training.losses.loss_token_mask)."""
    return loss_token_mask(batch).to(device)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(x.detach()[mask].float().sum() / n) if n else 0.0


def _engine_logprobs(batch: PackedBatch, like: torch.Tensor, loss: str) -> torch.Tensor:
    if batch.log_probs is None:
        raise ValueError(
            f"RL loss {loss!r} needs batch.log_probs (the engine's log-probs); got None"
        )
    return batch.log_probs.to(like.device, like.dtype)


def _tis_weight(
    old_trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached min(exp(old_trainer − engine), cap) [T] (1 outside the mask) and its metrics."""
    log_w = torch.where(mask, old_trainer.detach() - engine, torch.zeros_like(engine))
    raw = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
    w = raw.clamp(max=cap)
    return w, {
        "tis_weight_mean": _masked_mean(w, mask),
        "tis_clip_fraction": _masked_mean((raw > cap).float(), mask),
    }


def reinforce_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    config: RLLossConfig = RLLossConfig(),
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """per_token = −A · logprobs (× truncated IS weight). logprobs float32 [T] → ([T], metrics)."""
    mask = _loss_mask(batch, logprobs.device)
    adv = batch.token_weights.to(logprobs.device, logprobs.dtype)
    per_token = torch.where(mask, -adv * logprobs, torch.zeros_like(logprobs))
    metrics: dict[str, float] = {}
    if batch.log_probs is not None:
        engine = _engine_logprobs(batch, logprobs, "reinforce")
        gap = torch.where(mask, logprobs.detach() - engine, torch.zeros_like(engine))
        metrics["logprob_gap"] = _masked_mean(gap.abs(), mask)
        metrics["ratio_mean"] = _masked_mean(torch.exp(gap.clamp(max=_MAX_LOG_RATIO)), mask)
    if config.tis_cap > 0:
        engine = _engine_logprobs(batch, logprobs, "reinforce")
        old = logprobs if old_logprobs is None else old_logprobs.to(logprobs.device, logprobs.dtype)
        w, tis_metrics = _tis_weight(old, engine, mask, config.tis_cap)
        per_token = per_token * w
        metrics.update(tis_metrics)
    return per_token, metrics


def ppo_clip_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    config: RLLossConfig = RLLossConfig(name="ppo_clip"),
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """per_token = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), r = exp(logprobs − old). [T] → [T]."""
    mask = _loss_mask(batch, logprobs.device)
    engine = _engine_logprobs(batch, logprobs, "ppo_clip")
    old = engine if old_logprobs is None else old_logprobs.to(logprobs.device, logprobs.dtype)
    adv = batch.token_weights.to(logprobs.device, logprobs.dtype)
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old.detach(), zeros)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = torch.where(mask, -torch.minimum(ratio * adv, clipped * adv), zeros)
    r = ratio.detach()
    clip_active = ((adv > 0) & (r > 1.0 + config.epsilon_high)) | (
        (adv < 0) & (r < 1.0 - config.epsilon_low)
    )
    gap = torch.where(mask, logprobs.detach() - engine, zeros)
    metrics = {
        "clip_fraction": _masked_mean(clip_active.float(), mask),
        "ratio_mean": _masked_mean(r, mask),
        "logprob_gap": _masked_mean(gap.abs(), mask),
    }
    if config.tis_cap > 0:
        if old_logprobs is None:
            raise ValueError(
                "ppo_clip with tis_cap > 0 needs old_logprobs (the trainer's log-probs under the "
                "sampling weights); without them the ratio against the engine already covers the mismatch"
            )
        w, tis_metrics = _tis_weight(old, engine, mask, config.tis_cap)
        per_token = per_token * w
        metrics.update(tis_metrics)
    return per_token, metrics


_LOSS_FNS = {"reinforce": reinforce_loss, "ppo_clip": ppo_clip_loss}


def build_rl_loss(name: str = "reinforce", **options: Any) -> LossFn:
    """A loss_fn(logprobs, batch) for `name` with RLLossConfig options (unknown ones raise)."""
    known = {f.name for f in fields(RLLossConfig)} - {"name"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) for RL loss {name!r}: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    config = RLLossConfig(name=name, **options)  # validates name
    return functools.partial(_LOSS_FNS[name], config=config)


def _batch_key(batch: PackedBatch) -> tuple[str, ...]:
    """A micro-batch's rollouts (shared-prefix segments carry no sample_id)."""
    return tuple(s for s in batch.sample_ids if s)


def bind_old_logprobs(
    loss_fn: LossFn, batches: Sequence[PackedBatch], old_logprobs: Sequence[torch.Tensor]
) -> LossFn:
    """A loss_fn that passes each micro-batch its `old_logprobs` (matched by its sample_ids).

    For PPO epochs / TIS: compute the trainer's log-probs of every micro-batch once, under
    no_grad, before the first update; then train with the bound loss_fn. Micro-batches are
    matched by their sample_ids (unique within a run), which survive `batch.to(device)`.
    """
    if len(batches) != len(old_logprobs):
        raise ValueError(
            f"{len(batches)} micro-batches for {len(old_logprobs)} old_logprobs tensors"
        )
    table: dict[tuple[str, ...], torch.Tensor] = {}
    for b, lp in zip(batches, old_logprobs, strict=True):
        key = _batch_key(b)
        if not key or key in table:
            raise ValueError(
                "bind_old_logprobs needs micro-batches with unique, non-empty sample_ids"
            )
        if lp.shape != b.tokens.shape:
            raise ValueError(
                f"old_logprobs shape {tuple(lp.shape)} != tokens shape {tuple(b.tokens.shape)}"
            )
        table[key] = lp.detach()

    def bound(logprobs: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        key = _batch_key(batch)
        if key not in table:
            raise ValueError(
                f"no old_logprobs bound for micro-batch with sample_ids {list(key)[:3]}..."
            )
        return loss_fn(logprobs, batch, old_logprobs=table[key])  # type: ignore[call-arg]

    return bound
