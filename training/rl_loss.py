"""Policy-gradient losses in the loss_fn shape: `loss_fn(logprobs [T], batch) -> (per_token [T], metrics)`.

The advantage arrives as the token weight (RL packing puts each sequence's advantage on its
completion tokens and 0 on prompt tokens), so the losses never see groups or rewards. They return
UNNORMALISED per-token losses; `training.losses.reduce_loss` normalises over the optimizer step
(`loss_normaliser` says with which normaliser each loss is meant to run).

Choosing a loss is decided in one place, the registry `LOSSES` below the loss functions: per
loss its per-token function, the normaliser its objective is defined with, whether it takes
truncated importance weights and whether it allows std-scaled advantages. `RLLossOptions` refuses
options a loss does not define and `check_loss_choice` what a run may not combine with it; the
run config's `[rl]` section (training/config.py) validates through both.

Three log-probs of the same label tokens appear here; keep them apart:

    logprobs       [T]  the trainer's, under the weights being updated (carries the gradient)
    batch.log_probs [T] the engine's (generator's), recorded when the completion was sampled
    old_logprobs   [T]  the trainer's under the weights that sampled the batch, no gradient
                        (optional; on the first update of an on-policy batch = logprobs.detach())

Losses (`build_rl_loss(name, **options)`, options of `RLLossOptions`), A = advantage, r = exp(logprobs − old) per token,
old = old_logprobs when given, else the engine's batch.log_probs (then r also absorbs the
engine/trainer mismatch); log-ratios are clamped to ±20 so that a wild token cannot give inf:

- `reinforce` (default): per_token = −A · logprobs. On-policy REINFORCE with the group baseline in
  A; what "GRPO" reduces to with one optimizer step per batch (nanochat's chat_rl, TRL at
  num_iterations=1).
- `ppo_clip`: per_token = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) (Schulman et al. 2017, PPO;
  asymmetric "clip-higher" from DAPO, Yu et al. 2025, arXiv 2503.14476).
- `gspo`: one ratio per sequence, s = exp(mean over its completion tokens of (logprobs − old)),
  per_token = −min(s·A, clip(s, 1−ε_low, 1+ε_high)·A) on each of its tokens, the gradient flowing
  through the mean; normalised per sequence (Zheng et al. 2025, "Group Sequence Policy
  Optimization", arXiv 2507.18071, eq. 5-7; TRL `importance_sampling_level="sequence"` with
  `loss_type="grpo"`). The paper clips at ε = 3e-4 / 4e-4: set rl.loss.epsilon_low/high accordingly.
- `cispo`: per_token = −sg(min(r, cispo_cap)) · A · logprobs: REINFORCE with a clipped, detached
  importance weight, so no token loses its gradient (MiniMax-M1, arXiv 2506.13585, eq. 4-5, no
  lower bound; cap ε_max = 5 as in ScaleRL, arXiv 2510.13786; TRL `loss_type="cispo"`).
- `dr_grpo`: the `ppo_clip` per-token loss, normalised by a constant (sequences per step × max new
  tokens) instead of by each sequence's length, with advantages not divided by the group std
  (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783, eq. 3; TRL
  `loss_type="dr_grpo"`, which divides by batch size × max_completion_length).
- Truncated importance sampling (`tis_cap` > 0, reinforce and ppo_clip): multiply by the detached
  weight min(exp(old_trainer − engine), tis_cap), correcting for the engine sampling from a
  slightly different distribution than the trainer computes (other kernels, bf16). For
  `reinforce`, old_trainer = old_logprobs or logprobs.detach(); `ppo_clip` needs old_logprobs for
  it (else the weight would double-count the mismatch already in its ratio).
- KL to a reference policy (`kl_coef` > 0, any loss): + kl_coef · k(logprobs, ref_logprobs) per
  loss token, k one of training/kl.py's estimators; the reference log-probs are bound per
  micro-batch with `bind_batch_inputs` (training/loss_inputs.py).

Metrics (means over this micro-batch's loss tokens, `training.losses.loss_token_mask`):
`logprob_gap` = mean |trainer − engine| log-prob, `ratio_mean`, `clip_fraction` (share of
tokens whose clipped branch is active; cispo: whose weight hit the cap), `tis_weight_mean` and
`tis_clip_fraction` (with tis_cap), `kl` (with kl_coef).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from rlpipe.training.batch import PackedBatch
from rlpipe.training.kl import kl_estimate
from rlpipe.training.loss_choice import (  # noqa: F401 - named here too, where the losses are
    LOSS_NAMES,
    LOSS_RULES,
    LossRules,
    RLLossOptions,
    check_loss_choice,
    loss_normaliser,
)
from rlpipe.training.losses import LossFn, loss_token_mask, sequence_index

_MAX_LOG_RATIO = 20.0


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
    config: RLLossOptions | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """per_token = −A · logprobs (× truncated IS weight). logprobs float32 [T] → ([T], metrics)."""
    config = config or RLLossOptions()
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
    config: RLLossOptions | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """per_token = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), r = exp(logprobs − old). [T] → [T]."""
    config = config or RLLossOptions(name="ppo_clip")
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


def _old_logprobs(logprobs: torch.Tensor, batch: PackedBatch, old_logprobs: torch.Tensor | None,
                  loss: str) -> torch.Tensor:
    """The detached log-probs the ratio is taken against: old_logprobs, else the engine's."""
    if old_logprobs is not None:
        return old_logprobs.to(logprobs.device, logprobs.dtype).detach()
    return _engine_logprobs(batch, logprobs, loss).detach()


def _gap_metric(logprobs: torch.Tensor, batch: PackedBatch, mask: torch.Tensor) -> dict[str, float]:
    if batch.log_probs is None:
        return {}
    gap = torch.where(mask, logprobs.detach() - batch.log_probs.to(logprobs.device, logprobs.dtype),
                      torch.zeros_like(logprobs))
    return {"logprob_gap": _masked_mean(gap.abs(), mask)}


def gspo_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    config: RLLossOptions | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: s_i = exp(mean_t (logprobs − old)) per sequence; per_token = −min(s·A, clip(s)·A)
    on each of the sequence's loss tokens (gradient through the mean). [T] → [T]."""
    config = config or RLLossOptions(name="gspo")
    mask = _loss_mask(batch, logprobs.device)
    old = _old_logprobs(logprobs, batch, old_logprobs, "gspo")
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old, zeros)
    seq = sequence_index(batch).to(logprobs.device)
    n = batch.n_sequences
    seq_sum = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add(0, seq, log_ratio)
    seq_len = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add(
        0, seq, mask.to(logprobs.dtype))
    seq_log_ratio = (seq_sum / seq_len.clamp(min=1)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(seq_log_ratio)[seq]  # [T]: each token carries its sequence's ratio
    adv = batch.token_weights.to(logprobs.device, logprobs.dtype)
    clipped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = torch.where(mask, -torch.minimum(ratio * adv, clipped * adv), zeros)
    r = ratio.detach()
    clip_active = ((adv > 0) & (r > 1.0 + config.epsilon_high)) | (
        (adv < 0) & (r < 1.0 - config.epsilon_low))
    metrics = {"clip_fraction": _masked_mean(clip_active.float(), mask), "ratio_mean": _masked_mean(r, mask)}
    return per_token, metrics | _gap_metric(logprobs, batch, mask)


def cispo_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    config: RLLossOptions | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: per_token = −sg(min(r, cispo_cap)) · A · logprobs, r = exp(logprobs − old). [T] → [T]."""
    config = config or RLLossOptions(name="cispo")
    mask = _loss_mask(batch, logprobs.device)
    old = _old_logprobs(logprobs, batch, old_logprobs, "cispo")
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs.detach() - old, zeros).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=config.cispo_cap)  # detached: logprobs entered through .detach()
    adv = batch.token_weights.to(logprobs.device, logprobs.dtype)
    per_token = torch.where(mask, -weight * adv * logprobs, zeros)
    metrics = {"clip_fraction": _masked_mean((ratio > config.cispo_cap).float(), mask),
               "ratio_mean": _masked_mean(ratio, mask)}
    return per_token, metrics | _gap_metric(logprobs, batch, mask)


def dr_grpo_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    config: RLLossOptions | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO: the ppo_clip per-token loss; what differs is the normaliser (its `LOSSES` entry:
    a constant, not the sequence's length) and advantages without std scaling (check_loss_choice)."""
    config = config or RLLossOptions(name="dr_grpo")
    return ppo_clip_loss(logprobs, batch, config=config, old_logprobs=old_logprobs)


@dataclass(frozen=True, kw_only=True)
class LossKind(LossRules):
    """One policy loss of the registry: its rules (training/loss_choice.py) and its function."""

    policy_loss: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    """fn(logprobs [T], batch, *, config: RLLossOptions, old_logprobs=None) -> (per_token [T], metrics)."""


_FUNCTIONS = {"reinforce": reinforce_loss, "ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss,
              "dr_grpo": dr_grpo_loss}
LOSSES: dict[str, LossKind] = {
    name: LossKind(policy_loss=_FUNCTIONS[name], **vars(rules)) for name, rules in LOSS_RULES.items()
}
"""The policy losses by name, in the order `rl.loss.type` lists them."""


def build_rl_loss(name: str = "reinforce", **options: Any) -> LossFn:
    """`rl_loss_fn` of loss `name` with RLLossOptions options given by keyword (unknown ones raise)."""
    known = {f.name for f in fields(RLLossOptions)} - {"name"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) for RL loss {name!r}: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return rl_loss_fn(RLLossOptions(name=name, **options))  # validates name and options


def rl_loss_fn(config: RLLossOptions) -> LossFn:
    """A loss_fn(logprobs, batch, *, old_logprobs=None, ref_logprobs=None) of the registry's loss
    `config.name`. With kl_coef > 0 it needs ref_logprobs (training/loss_inputs.bind_batch_inputs)."""
    name = config.name
    policy_loss = functools.partial(LOSSES[name].policy_loss, config=config)
    if config.kl_coef == 0:
        return policy_loss

    def with_kl(logprobs: torch.Tensor, batch: PackedBatch, *, old_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        if ref_logprobs is None:
            raise ValueError(f"RL loss {name!r} with kl_coef > 0 needs ref_logprobs (the reference "
                             "policy's log-probs; bind them with bind_batch_inputs)")
        per_token, metrics = policy_loss(logprobs, batch, old_logprobs=old_logprobs)
        mask = _loss_mask(batch, logprobs.device)
        kl = kl_estimate(logprobs, ref_logprobs.to(logprobs.device), config.kl_estimator)
        per_token = per_token + torch.where(mask, config.kl_coef * kl, torch.zeros_like(kl))
        return per_token, metrics | {"kl": _masked_mean(kl, mask)}

    return with_kl
