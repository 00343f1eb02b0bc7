"""Stage `train`: micro-batches of one optimizer step → forward/backward → optimizer step.

The model and optimizer live in the flow's local variables for the whole run; this stage
mutates them in place and returns metrics (Prefect never hashes or persists them).
"""

from __future__ import annotations

import math
import time

from rlpipe.tasks._prefect import stage
from rlpipe.training.batch import PackedBatch
from rlpipe.training.distributed import capture_logprobs, lead_step, with_batch_inputs
from rlpipe.training.step import forward_backward, optim_step


class NonFiniteLossError(FloatingPointError):
    """A NaN or infinite loss or gradient: the step is refused, weights untouched."""


def train_on_batches(
    model,
    optimizer,
    scheduler,
    batches: list[PackedBatch],
    loss_fn,
    *,
    normaliser: str,
    max_grad_norm: float,
    autocast: bool,
    epochs: int = 1,
    step: int,
    temperature: float = 1.0,
    constant: float | None = None,
    entropy: bool = True,
    parallel=None,
    batch_inputs: dict[str, list] | None = None,
    trainer_logprobs: dict | None = None,
) -> dict[str, float]:
    """`epochs` optimizer steps over the same micro-batches (1 = on-policy); `constant` is the
    'constant' normaliser's divisor; `entropy` logs the policy's mean entropy (training/entropy.py).
    parallel: a DataParallel (tasks/ranks.py): the step runs on every rank, sharing `batches` out
    by tokens, and trains the wrapped model (`model` is then rank 0's whole-weight view).
    batch_inputs: per micro-batch loss inputs in the order of `batches` (e.g. the KL reference's
    `ref_logprobs`), bound to `loss_fn` by sample_ids. trainer_logprobs: filled with the trainer's
    per-token log-probs of every micro-batch (all ranks'; the last epoch's), by sample_ids."""
    start = time.perf_counter()
    if parallel is None:
        loss_fn = with_batch_inputs(loss_fn, batches, batch_inputs or {})
        if trainer_logprobs is not None:
            loss_fn = capture_logprobs(loss_fn, trainer_logprobs)
    metrics: dict[str, float] = {}
    if not any(bool((b.token_weights != 0).any()) for b in batches):
        # every weight (advantage) is 0, e.g. all groups zero-variance and kept: no signal, no update
        return {"loss": 0.0, "skipped": 1.0, "tokens": 0, "seconds": time.perf_counter() - start,
                "tokens_per_second": 0.0}
    model.train()
    for _ in range(epochs):
        try:
            if parallel is not None:
                metrics = dict(lead_step(parallel, optimizer, scheduler, batches, loss_fn, max_grad_norm,
                                         batch_inputs=batch_inputs, trainer_logprobs=trainer_logprobs,
                                         normaliser=normaliser, constant=constant, autocast=autocast,
                                         temperature=temperature, entropy=entropy))
            else:
                metrics = dict(forward_backward(model, batches, loss_fn, normaliser=normaliser, constant=constant,
                                                autocast=autocast, temperature=temperature, entropy=entropy))
                metrics.update(optim_step(model, optimizer, scheduler, max_grad_norm))
        except FloatingPointError as error:
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"step {step}, stage train: {error}") from error
        if not math.isfinite(float(metrics.get("loss", 0.0))):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"step {step}, stage train: loss is {metrics['loss']}")
    tokens = sum(b.n_tokens for b in batches)
    metrics["tokens"] = tokens * epochs
    metrics["seconds"] = time.perf_counter() - start
    metrics["tokens_per_second"] = metrics["tokens"] / max(metrics["seconds"], 1e-9)
    return metrics


@stage("train")
def train_task(model, optimizer, scheduler, batches, loss_fn, **kwargs) -> dict[str, float]:
    return train_on_batches(model, optimizer, scheduler, batches, loss_fn, **kwargs)


