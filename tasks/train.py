"""Stage `train`: micro-batches of one optimizer step → forward/backward → optimizer step.

The trainer (model, optimizer, scheduler: training/trainer.py) lives in the flow's local
variables for the whole run; this stage mutates it in place and returns metrics (Prefect never
hashes or persists them). One process or data-parallel ranks: the same call. The stage writes
the micro-batches it trained on, with the trainer's log-probs, as `train_tokens` (tasks/tokens.py).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from rlpipe.rollouts.records import TrainSample
from rlpipe.storage.stage_tables import stage
from rlpipe.tasks.tokens import TRAIN_TOKENS
from rlpipe.training.batch import PackedBatch
from rlpipe.training.trainer import Logprobs, Trainer


class NonFiniteLossError(FloatingPointError):
    """A NaN or infinite loss or gradient: the step is refused, weights untouched."""


def train_on_batches(trainer: Trainer, batches: list[PackedBatch], loss_fn, *, step: int,
                     trainer_logprobs: Logprobs | None = None) -> dict[str, float]:
    """`trainer.options.epochs` optimizer steps over the same micro-batches (1 = on-policy), the
    trainer's per micro-batch inputs (the KL reference's log-probs) computed once and bound to
    `loss_fn` by sample_ids. trainer_logprobs: filled with the trainer's per-token log-probs of
    every micro-batch (the last epoch's), by sample_ids."""
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if not any(bool((b.token_weights != 0).any()) for b in batches):
        # every weight (advantage) is 0, e.g. all groups zero-variance and kept: no signal, no update
        return {"loss": 0.0, "skipped": 1.0, "tokens": 0, "seconds": time.perf_counter() - start,
                "tokens_per_second": 0.0}
    compiled_before = compile_seconds_so_far()
    inputs = trainer.reference_inputs(batches)
    trainer.model.train()
    epochs = trainer.options.epochs
    for _ in range(epochs):
        try:
            metrics = trainer.step(batches, loss_fn, inputs, trainer_logprobs)
        except FloatingPointError as error:
            trainer.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"step {step}, stage train: {error}") from error
        if not math.isfinite(float(metrics.get("loss", 0.0))):
            trainer.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"step {step}, stage train: loss is {metrics['loss']}")
    tokens = sum(b.n_tokens for b in batches)
    metrics["tokens"] = tokens * epochs
    metrics["seconds"] = time.perf_counter() - start
    metrics["tokens_per_second"] = metrics["tokens"] / max(metrics["seconds"], 1e-9)
    compiled = compile_seconds_so_far() - compiled_before
    if compiled > 0:
        metrics["compile_seconds"] = compiled
        _log_first_compile(step, compiled, metrics["seconds"])
    return metrics


def compile_seconds_so_far() -> float:
    """Seconds torch.compile has spent in this process (0 until anything compiled: dynamo is
    imported only by a compile, so a run without train.compile never loads it here)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from rlpipe.models.compile import compile_seconds

    return compile_seconds()


_logged_compile: list[bool] = []


def _log_first_compile(step: int, compiled: float, seconds: float) -> None:
    """One log line for the first step of this process that compiled (recompiles for a new
    length or mode stay in the `perf/compile_seconds` metric alone)."""
    if not _logged_compile:
        _logged_compile.append(True)
        sys.stderr.write(f"rlpipe: train.compile: step {step} spent {compiled:.1f} s of its {seconds:.1f} s "
                         "compiling (later steps reuse the graphs)\n")


@stage("train", tables=(TRAIN_TOKENS,))
def train_task(trainer: Trainer, batches: list[PackedBatch], loss_fn, *, samples: list[TrainSample],
               trainer_logprobs: Logprobs, step: int, run_dir: Path, run_id: str) -> dict[str, float]:
    """The `train` stage: `train_on_batches`, the trainer's log-probs kept in `trainer_logprobs`
    (give an empty dict) and written with the micro-batches of `samples` as `train_tokens`."""
    return train_on_batches(trainer, batches, loss_fn, step=step, trainer_logprobs=trainer_logprobs)
