"""Stage `origin`: where a run's starting weights came from, recorded once before its first step.

A run that starts from a checkpoint (the pipeline's RL phase from the SFT checkpoint, or
`model.path`) writes one `origins` row (step 0) naming the checkpoint, the run and step that
wrote it and its registered model version, and tags its MLflow run (`rlpipe.parent_*`) and every
model version it registers (`parent_*`) with the same, so `rlpipe lineage` can walk from an RL
version to the SFT version it started from. Rewritten identically on resume.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.storage.lineage import checkpoint_origin
from rlpipe.tasks.record import persist_now


def record_origin(run_dir: Path, run_id: str, checkpoint: str | None, tracker) -> dict | None:
    """Record the starting checkpoint (None: a fresh preset, nothing to record); the row."""
    if not checkpoint:
        return None
    row = {"run_id": run_id, "step": 0, **checkpoint_origin(checkpoint)}
    persist_now(run_dir, "origins", 0, [row], run_id)
    tracker.set_lineage_tags({key: value for key, value in row.items() if key.startswith("parent_")})
    return row
