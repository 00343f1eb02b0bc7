"""Stage `origin`: where a run's starting weights came from, recorded once before its first step.

A run that starts from a checkpoint (the pipeline's RL phase from the SFT checkpoint, or
`model.path`) writes one `origins` row (step 0) naming the checkpoint, the run and step that
wrote it and its registered model version (for a hub id, `parent_checkpoint` is `ORG/NAME@COMMIT`:
the snapshot's commit, which replay and lineage load again), and tags its MLflow run (`rlpipe.parent_*`) and every
model version it registers (`parent_*`) with the same, so `rlpipe lineage` can walk from an RL
version to the SFT version it started from. Rewritten identically on resume.

The stage declares the `origins` table: the stage wrapper writes the row (storage/stage_tables.py),
synchronously and fsynced, before the run's first step.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.models.loading import hub_id, model_source
from rlpipe.storage.lineage import checkpoint_origin
from rlpipe.storage.stage_tables import StageTable, stage

ORIGINS = StageTable("origins", rows=lambda row, a: None if row is None else [row], durable=True)
"""The run's one `origins` row (partition step 0); nothing for a fresh preset."""


@stage("origin", tables=(ORIGINS,))
def origin_task(checkpoint: str | None, tracker, *, run_dir: Path, run_id: str, step: int = 0) -> dict | None:
    """Record the starting checkpoint (None: a fresh preset, nothing to record): tag the tracker
    with its lineage and return the `origins` row (`step` 0: before the run's first step)."""
    if not checkpoint:
        return None
    found = {"parent_checkpoint": model_source(checkpoint)} if hub_id(checkpoint) else checkpoint_origin(checkpoint)
    row = {"run_id": run_id, "step": step, **found}
    tracker.set_lineage_tags({key: value for key, value in row.items() if key.startswith("parent_")})
    return row
