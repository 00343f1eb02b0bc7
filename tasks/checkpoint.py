"""Stage `checkpoint`: save the weights in Hugging Face format, register them in MLflow, and
record the `checkpoints` row that links a checkpoint to the tables of its run.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.tasks._prefect import stage
from rlpipe.tasks.record import StageTable, drain_writes, load_rows, persist_now
from rlpipe.training.checkpoint import CheckpointOptions, CheckpointRecord, save_checkpoint


def checkpoint_row(run_id: str, step: int, policy_version: int, path: Path, model_name: str | None,
                   version: int | None) -> dict:
    metadata = json.loads((path / "metadata.json").read_text())
    return {
        "run_id": run_id,
        "step": step,
        "policy_version": policy_version,
        "path": str(path.resolve()),
        "sha256": metadata.get("sha256", ""),
        "mlflow_model_name": model_name,
        "mlflow_model_version": None if version is None else str(version),
        "created_at": dt.datetime.now(dt.UTC),
    }


def reloaded_by_vllm_servers(engine_config) -> bool:
    """Whether the run's checkpoints are reloaded by vLLM servers (`vllm+http://` engine urls):
    then a tied model's checkpoints name their lm_head (training/checkpoint.py says why)."""
    from rlpipe.engines.http import parse_engine_url

    return engine_config.type == "http" and any(parse_engine_url(u)[0] == "vllm" for u in engine_config.urls)


@dataclass(frozen=True)
class RegisterOptions:
    """How a run's checkpoints are saved and registered (built once per run: `register_options`)."""

    model_name: str | None = None
    """The MLflow registered model each checkpoint becomes a version of; None: not registered."""
    save: CheckpointOptions = field(default_factory=CheckpointOptions)
    """How each checkpoint is written (training/checkpoint.py)."""


def register_options(engine_config, model_name: str | None) -> RegisterOptions:
    """The checkpoint options of a run whose engines are `engine_config`, registered as `model_name`."""
    return RegisterOptions(model_name, CheckpointOptions(explicit_lm_head=reloaded_by_vllm_servers(engine_config)))


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint saves of a run in training: the model and its tokenizer, the optimizer
    and the scheduler (None: not saved)."""

    model: Any
    tokenizer: Any
    optimizer: Any = None
    scheduler: Any = None


def save_and_register(
    *, run_dir: Path, run_id: str, step: int, state: TrainingState, record: CheckpointRecord, tracker,
    options: RegisterOptions,
) -> dict:
    """Save the step's checkpoint, register it as a version of `options.model_name` (with a
    tracker), and return its `checkpoints` row."""
    path = save_checkpoint(run_dir, step, state.model, state.tokenizer, state.optimizer, state.scheduler,
                           record, options.save)
    version, policy_version = None, step if record.policy_version is None else record.policy_version
    if tracker is not None and options.model_name:
        version = tracker.register_checkpoint(
            path, options.model_name,
            tags={"run_dir": str(Path(run_dir).resolve()), "run_id": run_id, "step": str(step),
                  "policy_version": str(policy_version)},
        )
    return checkpoint_row(run_id, step, policy_version, Path(path), options.model_name, version)


CHECKPOINT_TABLES = (
    StageTable("train_steps", rows=lambda _, a: [a["train_row"]], first=True),
    StageTable("checkpoints", rows=lambda row, a: None if row is None else [row], durable=True),
)
"""The step's `train_steps` row before anything else; the `checkpoints` row at once after the checkpoint."""


@stage("checkpoint", tables=CHECKPOINT_TABLES)
def checkpoint_task(*, train_row: dict, checkpoint: bool, run_dir: Path, run_id: str, step: int,
                    **kwargs) -> dict | None:
    """Finish a step: its `train_steps` row (`train_row`), then (when `checkpoint`) every queued
    table write on disk, the checkpoint that marks the step done, and its `checkpoints` row
    (returned) written at once.

    A resume starts after the newest checkpoint, so nothing the step wrote may still be queued when
    it appears; the `checkpoints` row (it needs the registered version) comes right after, and
    `repair_checkpoint_row` rewrites it on resume if a kill fell in between.
    """
    if not checkpoint:
        return None
    drain_writes()
    return save_and_register(run_dir=run_dir, run_id=run_id, step=step, **kwargs)


def repair_checkpoint_row(run_dir: Path, run_id: str, step: int, path: Path, model_name: str | None) -> None:
    """Write the `checkpoints` row of the checkpoint a run resumes from when a kill right after
    its rename lost it (its MLflow model version, if any, is then unknown: null)."""
    if load_rows(run_dir, "checkpoints", step) is None:
        metadata = json.loads((Path(path) / "metadata.json").read_text())
        version = int(metadata.get("policy_version", step))
        persist_now(run_dir, "checkpoints", step, [checkpoint_row(run_id, step, version, Path(path),
                                                                  model_name, None)], run_id)


def promote_best(tracker, model_name: str, row: dict | None, accuracy: float | None, best: float) -> float:
    """Move the registry's `best` alias to this checkpoint when its eval beats `best`; the new best."""
    if row is None or accuracy is None or accuracy <= best or not row["mlflow_model_version"]:
        return best
    tracker.set_alias(model_name, "best", row["mlflow_model_version"])
    return accuracy
