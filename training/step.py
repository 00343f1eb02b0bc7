"""The functional training step: forward/backward over micro-batches, then an optimizer step.

    totals-normalised loss      forward_backward(model, batches, loss_fn, StepOptions(normaliser="token"))
    clip, step, schedule        optim_step(model, optimizer, scheduler, max_grad_norm)

State (model, optimizer, scheduler) lives with the caller and is passed in; nothing here keeps
any. `forward_backward` accumulates gradients over the micro-batches of ONE optimizer step with
the normaliser computed over the whole step (losses.normaliser_totals), so the gradient does not
depend on how the step was split into micro-batches. The step is algorithm-blind: pretraining,
SFT and RL differ only in `loss_fn` and the token weights inside the batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rlpipe.models.device import model_device
from rlpipe.models.loading import autocast_context
from rlpipe.training.batch import PackedBatch
from rlpipe.training.entropy import token_logprobs_and_entropy
from rlpipe.training.logprobs import token_logprobs
from rlpipe.training.losses import (
    LossFn,
    Normaliser,
    batch_counts,
    loss_token_mask,
    normaliser_totals,
    reduce_loss,
)


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How `forward_backward` computes one step's loss and gradients (built once per phase by its
    trainer's options, training/trainer.py `TrainOptions`)."""

    normaliser: Normaliser = "token"
    """The loss normaliser over the whole step (training/losses.py)."""
    constant: float | None = None
    """The 'constant' normaliser's divisor."""
    autocast: bool = False
    """bf16 autocast of the forward where the device supports it."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are computed at."""
    aux_loss_coef: float | None = None
    """Weight of the router aux loss; None: the model config's `router_aux_loss_coef` (0 if absent)."""
    chunk_size: int = 1024
    """Tokens per chunk of the LM-head log-prob computation."""
    entropy: bool = False
    """Also report the policy's mean entropy over the loss tokens (training/entropy.py)."""
    head: str = "auto"
    """`train.logprobs`: the LM head's log-prob path, "auto" | "fused" | "chunked" (training/fused_head.py)."""


def _non_finite(loss: torch.Tensor, what: str, index: int, batch: PackedBatch) -> FloatingPointError:
    ids = [s for s in batch.sample_ids if s][:5]
    where = f" (sample_ids {ids}{'...' if len(batch.sample_ids) > 5 else ''})" if ids else ""
    return FloatingPointError(
        f"non-finite {what} ({float(loss.detach())}) in micro-batch {index} of {batch.n_tokens} tokens"
        f"{where}; gradients were cleared and no optimizer step should be taken"
    )


class SingleProcess:
    """The ranks of a step when one process trains it: its counts, figures and gradients are
    its own. training/distributed.DataParallel is the same interface over several ranks."""

    grad_scale = 1.0
    """Factor on each micro-batch's loss before backward (1: nothing averages gradients)."""

    def totals(self, batches: Sequence[PackedBatch], normaliser: Normaliser) -> dict[str, int]:
        """The step's normaliser counts (losses.normaliser_totals)."""
        return normaliser_totals(batches, normaliser)

    def counts(self, batch: PackedBatch) -> dict[str, int]:
        """What one micro-batch adds to the step's counts."""
        return batch_counts(batch)

    def sync(self, last: bool):
        """No gradient reduction to defer: a null context."""
        return contextlib.nullcontext()

    def forward(self, model: torch.nn.Module, batch: PackedBatch, *, temperature: float, chunk_size: int,
                entropy: bool, head: str = "chunked"):
        """(per-token log-probs, router aux loss or None, per-token entropy or None)."""
        return policy_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                               head=head)

    def reduce(self, loss_sum: float, aux_sum: float, fn_sums: dict[str, float], fn_weights: dict[str, float]):
        """The step's figures as reported: this process's own."""
        return loss_sum, aux_sum, fn_sums, fn_weights


SINGLE_PROCESS = SingleProcess()


def policy_logprobs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                    chunk_size: int = 1024, entropy: bool = False, head: str = "chunked"):
    """(log-probs [T], aux loss or None, entropy [T] without gradient, or None without `entropy`)."""
    if entropy:
        return token_logprobs_and_entropy(model, batch, temperature=temperature, chunk_size=chunk_size, head=head)
    logprobs, aux = token_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size, head=head)
    return logprobs, aux, None


def forward_backward(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    loss_fn: LossFn,
    options: StepOptions = StepOptions(),
    ranks=SINGLE_PROCESS,
) -> dict[str, float]:
    """Accumulate the gradients of one optimizer step over `batches` (its micro-batches).

    loss = Σ_batches reduce_loss(loss_fn(logprobs, batch)) with `options.normaliser` (+
    options.aux_loss_coef × router aux loss, averaged over micro-batches by token share).
    Returns metrics: loss (the step's objective, without aux), aux_loss (if any), tokens,
    loss_tokens, sequences, seconds, and loss_fn's metrics averaged over micro-batches weighted
    by their loss tokens; with `options.entropy`, also the policy's mean entropy over the
    loss tokens (training/entropy.py, one more LM-head matmul per token). Raises FloatingPointError
    on a NaN/inf loss, after clearing the gradients (the caller must not step).
    ranks: who shares the step (`SingleProcess`, or a training.distributed.DataParallel whose
    `batches` are this rank's micro-batches: the normaliser counts and the returned figures then
    cover every rank, and the gradients equal one process's over all ranks' batches).
    """
    if len(batches) == 0:
        raise ValueError("forward_backward: no micro-batches")
    start = time.perf_counter()
    totals = ranks.totals(batches, options.normaliser)
    device = model_device(model)
    aux_loss_coef = options.aux_loss_coef
    if aux_loss_coef is None:
        aux_loss_coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)

    loss_sum = 0.0
    aux_sum = 0.0
    has_aux = False
    fn_sums: dict[str, float] = {}
    fn_weights: dict[str, float] = {}
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        counts = ranks.counts(batch)
        with ranks.sync(last=i == len(batches) - 1):  # forward and backward: DDP decides in its forward
            with autocast_context(device, options.autocast):
                logprobs, aux, token_entropy = ranks.forward(model, batch, temperature=options.temperature,
                                                             chunk_size=options.chunk_size,
                                                             entropy=options.entropy, head=options.head)
                per_token, fn_metrics = loss_fn(logprobs, batch)
                if token_entropy is not None:
                    mask = loss_token_mask(batch).to(token_entropy.device)
                    fn_metrics = {**fn_metrics,
                                  "entropy": float(token_entropy[mask].sum() / max(int(mask.sum()), 1))}
                loss = reduce_loss(per_token, batch, options.normaliser, totals, options.constant)
            _backward_after_checks(model, loss, aux, i, batch, counts, totals, aux_loss_coef, ranks.grad_scale)
        if aux is not None:
            has_aux = True
            aux_sum += float(aux.detach()) * counts["tokens"] / totals["tokens"]
        loss_sum += float(loss.detach())
        # Weight micro-batch metrics by loss tokens (a micro-batch without any counts once).
        w = float(counts["loss_tokens"]) or 1e-9
        for key, value in fn_metrics.items():
            fn_sums[key] = fn_sums.get(key, 0.0) + w * float(value)
            fn_weights[key] = fn_weights.get(key, 0.0) + w

    # the step's figures over every rank, as one process would report them
    loss_sum, aux_sum, fn_sums, fn_weights = ranks.reduce(loss_sum, aux_sum, fn_sums, fn_weights)
    metrics: dict[str, float] = {k: fn_sums[k] / fn_weights[k] for k in fn_sums}
    metrics.update(
        loss=loss_sum,
        tokens=float(totals["tokens"]),
        loss_tokens=float(totals["loss_tokens"]),
        sequences=float(totals["sequences"]),
        micro_batches=float(len(batches)),
        seconds=time.perf_counter() - start,
    )
    if has_aux:
        metrics["aux_loss"] = aux_sum
    return metrics


def _backward_after_checks(model, loss, aux, index, batch, counts, totals, aux_loss_coef, grad_scale) -> None:
    """Backward of one micro-batch's loss (+ its share of the router aux loss); a non-finite
    value clears the gradients and raises instead."""
    if not torch.isfinite(loss):
        model.zero_grad(set_to_none=True)
        raise _non_finite(loss, "loss", index, batch)
    total = loss
    if aux is not None:
        if not torch.isfinite(aux):
            model.zero_grad(set_to_none=True)
            raise _non_finite(aux, "router aux loss", index, batch)
        if aux_loss_coef:
            total = total + aux_loss_coef * counts["tokens"] / totals["tokens"] * aux
    (total * grad_scale if grad_scale != 1.0 else total).backward()


def _no_decay(name: str, param: torch.nn.Parameter, embedding_ids: set[int]) -> bool:
    """Norm weights, biases and embeddings are not weight-decayed (they set scales, not mixes)."""
    return param.ndim < 2 or name.endswith(".bias") or id(param) in embedding_ids


OPTIMIZERS = ("adamw", "adamw_bf16_sr")


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    kind: str = "adamw",
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no decay on norms, biases and embeddings.

    kind "adamw": torch's AdamW, its state in the parameters' dtype; on CUDA the fused kernel (one
    launch for all parameters, rather than foreach's per-op launches). kind "adamw_bf16_sr"
    (`optim.optimizer`, the `lean` extra): torchao's AdamW with bf16 stochastic rounding, for bf16
    weights: each update is computed in fp32 and rounded to bf16 up or down with the probabilities
    that make the rounding exact in expectation, so an update far below a weight's bf16 spacing
    still moves it on average, where round-to-nearest drops it (at lr 1e-6, plain bf16 AdamW kept
    about 3% of 20 steps' movement in tests/unit/test_optimizers.py). Memory as pure bf16: no
    fp32 master copy."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optim.optimizer must be one of {OPTIMIZERS}; got {kind!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0; got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
    embedding_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # tied parameters are listed once
        if param.requires_grad:
            (no_decay if _no_decay(name, param, embedding_ids) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    params = decay + no_decay
    groups = [g for g in groups if g["params"]]
    if kind == "adamw_bf16_sr":
        return _stochastic_rounding_adamw(groups, lr, betas, eps)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=_fused_adam_applies(params) or None)


def _stochastic_rounding_adamw(groups: list[dict], lr: float, betas: tuple[float, float],
                               eps: float) -> torch.optim.Optimizer:
    """torchao's AdamW with bf16 stochastic rounding over bf16 parameters (see build_optimizer)."""
    dtypes = {p.dtype for g in groups for p in g["params"]}
    if dtypes != {torch.bfloat16}:
        raise ValueError(f"optim.optimizer = 'adamw_bf16_sr' rounds bf16 weights; these are "
                         f"{sorted(str(d).removeprefix('torch.') for d in dtypes)} (set model.weights_dtype = 'bfloat16')")
    try:
        from torchao.optim import _AdamW
    except ImportError as error:
        raise ValueError(f"optim.optimizer = 'adamw_bf16_sr' needs torchao (pip install 'rlpipe[lean]'): {error}") from None
    return _AdamW(groups, lr=lr, betas=betas, eps=eps, bf16_stochastic_round=True)


def _fused_adam_applies(params: list[torch.Tensor]) -> bool:
    """Plain CUDA tensors only: FSDP2's sharded DTensors keep the default (foreach) path, and the
    CPU keeps it too (its results are what the CPU tests pin)."""
    return bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for the `step`-th optimizer step (0-based): linear warmup over
    `warmup_steps` steps (the first step already gets 1/warmup), then cosine down to
    `min_lr_ratio` at `total_steps`, flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to min_lr_ratio × lr (see `lr_factor`)."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"need warmup_steps >= 0 and total_steps >= 1; got {warmup_steps}, {total_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1]; got {min_lr_ratio}")

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps, total_steps, min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optim_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """Clip gradients to max_grad_norm (None or <= 0: measure only), step the optimizer and the
    scheduler, clear gradients. Returns {grad_norm (before clipping), lr (used by this step)}.

    A non-finite gradient norm raises FloatingPointError after clearing the gradients, without
    stepping.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        raise ValueError("optim_step: no parameter has a gradient; call forward_backward first")
    clip = max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"non-finite gradient norm ({grad_norm}); gradients cleared, optimizer not stepped"
        )
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr}
