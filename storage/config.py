"""The config section of tracking (`[tracking]`): MLflow, the report and the per-stage task runs.

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes it into a run's
`RunConfig`.
"""

from __future__ import annotations

from rlpipe.core.config import Section


class TrackingConfig(Section):
    """`[tracking]`: MLflow, the report and per-stage task runs."""

    enabled: bool = True
    """Log to MLflow (a SQLite database under runs_root unless MLFLOW_TRACKING_URI is set)."""
    experiment: str = "rlpipe"
    """MLflow experiment name."""
    registered_model: str = ""
    """Register checkpoints as versions of this model ('' = the run name)."""
    report: bool = True
    """Write <run_dir>/report.html at the end of the run."""
    prefect_task_runs: bool = True
    """One Prefect task run per stage, seen in the Prefect UI. false: stages are plain calls inside
    the flow run (3-10 ms less per stage: worth it when steps take well under a second)."""
