"""Stage `checkpoint`: save the weights in Hugging Face format, register them in MLflow, and
record the `checkpoints` row that links a checkpoint to the tables of its run.

A checkpoint's commit is its folder's rename, then its registered version, then its row. A kill
between them leaves a folder without a version or a row: a resumed phase calls
`complete_registrations` before its first step, which registers such a checkpoint (finding the
version an earlier attempt registered, by the run, step and sha256 tags) and writes its row.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.storage.stage_tables import (
    StageTable,
    compact_closed_steps,
    drain_writes,
    load_rows,
    persist_now,
    stage,
    stored_row,
)
from rlpipe.training.checkpoint_files import checkpoint_dir, checkpoint_steps, verify_checkpoint
from rlpipe.training.checkpoint_io import CheckpointOptions, CheckpointRecord, save_checkpoint
from rlpipe.training.checkpoint_retention import Retained, pending_removals, retain


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
    then a tied model's checkpoints name their lm_head (training/checkpoint_io.py says why)."""
    from rlpipe.engines.http import parse_engine_url

    return engine_config.type == "http" and any(parse_engine_url(u)[0] == "vllm" for u in engine_config.urls)


@dataclass(frozen=True)
class RegisterOptions:
    """How a run's checkpoints are saved and registered (built once per run: `register_options`)."""

    model_name: str | None = None
    """The MLflow registered model each checkpoint becomes a version of; None: not registered."""
    save: CheckpointOptions = field(default_factory=CheckpointOptions)
    """How each checkpoint is written (training/checkpoint_io.py)."""
    keep_last: int = 0
    """`checkpoint.keep_last`: the newest checkpoints kept beside the pinned ones (0 = every one)."""


def register_options(engine_config, model_name: str | None, keep_last: int = 0) -> RegisterOptions:
    """The checkpoint options of a run whose engines are `engine_config`, registered as `model_name`,
    keeping the newest `keep_last` checkpoints (0: all)."""
    return RegisterOptions(model_name, CheckpointOptions(explicit_lm_head=reloaded_by_vllm_servers(engine_config)),
                           keep_last)


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
    policy_version = step if record.policy_version is None else record.policy_version
    version = register(tracker, options.model_name, run_dir=run_dir, run_id=run_id, step=step,
                       policy_version=policy_version, path=Path(path))
    return checkpoint_row(run_id, step, policy_version, Path(path), options.model_name, version)


def register(tracker, model_name: str | None, *, run_dir: Path, run_id: str, step: int, policy_version: int,
             path: Path) -> str | None:
    """Register a checkpoint folder as a version of `model_name` (None, or no tracker: nothing),
    tagged with where it comes from and its sha256, so registering it again (a resume completing
    the commit a kill interrupted) finds that version instead of adding one."""
    if tracker is None or not model_name:
        return None
    sha256 = json.loads((path / "metadata.json").read_text()).get("sha256", "")
    version = tracker.register_checkpoint(
        path, model_name,
        tags={"run_dir": str(Path(run_dir).resolve()), "run_id": run_id, "step": str(step),
              "policy_version": str(policy_version), "sha256": sha256},
    )
    return None if version is None else str(version)


def complete_registrations(*, run_dir: Path, run_id: str, tracker, options: RegisterOptions) -> list[int]:
    """Complete the commit of every checkpoint of a resumed run that a kill interrupted after
    its folder's rename: register a checkpoint that has no registered version (the one already
    registered is found, never a second) and write its `checkpoints` row. Returns the steps
    completed. A damaged checkpoint is named (ValueError), never registered. Then a retention pass
    (`retain_checkpoints`) finishes any removal a kill interrupted."""
    completed = []
    for step in sorted(checkpoint_steps(run_dir)):
        rows = load_rows(run_dir, "checkpoints", step)
        if rows and (rows[0]["mlflow_model_version"] is not None or not options.model_name
                     or rows[0]["mlflow_model_name"] is None):  # None: left unregistered (untrained weights)
            continue
        path = checkpoint_dir(run_dir, step)
        metadata = verify_checkpoint(path)
        policy_version = int(metadata.get("policy_version", step))
        version = register(tracker, options.model_name, run_dir=run_dir, run_id=run_id, step=step,
                           policy_version=policy_version, path=path)
        if rows and version is None:
            continue  # no registry: the row is complete with a null version
        persist_now(run_dir, "checkpoints", step,
                    [checkpoint_row(run_id, step, policy_version, path, options.model_name, version)], run_id)
        completed.append(step)
    retain_checkpoints(run_dir=run_dir, tracker=tracker, options=options)  # and finish a killed pass
    return completed


CHECKPOINT_TABLES = (
    StageTable("train_steps", rows=lambda _, a: [a["train_row"]], first=True),
    StageTable("checkpoints", rows=lambda row, a: None if row is None else [row], durable=True),
)
"""The step's `train_steps` row before anything else; the `checkpoints` row at once after the checkpoint."""


@stage("checkpoint", tables=CHECKPOINT_TABLES, works=lambda kwargs: bool(kwargs.get("checkpoint")))
def checkpoint_task(*, train_row: dict, checkpoint: bool, run_dir: Path, run_id: str, step: int,
                    **kwargs) -> dict | None:
    """Finish a step: its `train_steps` row (`train_row`), then (when `checkpoint`) every queued
    table write on disk, the checkpoint that marks the step done, and its `checkpoints` row
    (returned) written at once. A step whose checkpoint is not due writes its row in a plain call:
    no `checkpoint` task run that does nothing.

    A resume starts after the newest checkpoint, so nothing the step wrote may still be queued when
    it appears; its registered version and the `checkpoints` row come right after, and
    `complete_registrations` completes both on resume if a kill fell in between.
    """
    if not checkpoint:
        return None
    drain_writes()
    return save_and_register(run_dir=run_dir, run_id=run_id, step=step, **kwargs)


def after_checkpoint(*, run_dir: Path, step: int, tracker, options: RegisterOptions) -> Retained:
    """What follows a step's checkpoint once `best` has moved: the retention pass
    (`retain_checkpoints`), and a compaction pass over the steps it closed, queued on the
    background table writer (storage/compaction.py)."""
    compact_closed_steps(run_dir, step)
    return retain_checkpoints(run_dir=run_dir, tracker=tracker, options=options)


def retain_checkpoints(*, run_dir: Path, tracker, options: RegisterOptions) -> Retained:
    """`checkpoint.keep_last`: a retention pass (training/checkpoint_retention.py `retain`) that
    keeps the newest `keep_last` checkpoints, those a registry alias points to (`best`) and the
    newest version's (`@latest`), and retires the registered version of each removed one
    (storage/tracking.py `retire_version`: tagged, artifact copy deleted).

    Per checkpoint: the folder is renamed to its hidden `.deleting-` name, its version retired, the
    folder deleted; a kill anywhere leaves a whole checkpoint or a marked leftover that the next
    pass (a resumed phase runs one before its first step) finishes."""
    if not options.keep_last and not pending_removals(run_dir):
        return Retained()
    registry = tracker if tracker is not None and options.model_name else None
    pinned_versions = registry.pinned_versions(options.model_name) if registry is not None else set()
    versions: dict[int, str | None] = {}

    def version_of(step: int) -> str | None:
        if step not in versions:
            row = stored_row(run_dir, "checkpoints", step)
            versions[step] = None if row is None else row["mlflow_model_version"]
        return versions[step]

    reason = f"checkpoint retention (checkpoint.keep_last = {options.keep_last}) removed the checkpoint folder"

    def retire(step: int) -> None:
        if registry is not None and (version := version_of(step)) is not None:
            registry.retire_version(options.model_name, version, f"{reason} of step {step}")

    pinned = {step for step in checkpoint_steps(run_dir) if pinned_versions and version_of(step) in pinned_versions}
    return retain(run_dir, options.keep_last, pinned, retire)


def promote_best(tracker, model_name: str, row: dict | None, accuracy: float | None, best: float) -> float:
    """Move the registry's `best` alias to this checkpoint when its eval beats `best`; the new best.
    A row whose version is of another registered model (a copied or moved run resumed under its
    folder's name: its stored rows name the original's) moves no alias, but is still the best so far."""
    if row is None or accuracy is None or accuracy <= best or not row["mlflow_model_version"]:
        return best
    if row.get("mlflow_model_name") in (None, model_name):
        tracker.set_alias(model_name, "best", row["mlflow_model_version"])
    return accuracy
