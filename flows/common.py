"""What every flow does around its stages: the run directory, its state file, tracking, logging.

A run directory holds `config.json` (the resolved config), `run.json` (ids that must survive a
resume: the MLflow run id, the phase status), `tables/`, `checkpoints/` and `catalog.duckdb`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.core.files import atomic_write
from rlpipe.tasks.config import RunConfig


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` atomically (core/files.py `atomic_write`, not fsynced)."""
    text = json.dumps(data, indent=2, default=str)
    atomic_write(path, lambda tmp: tmp.write_text(text), durable=False)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@dataclass
class RunState:
    """The small, persisted identity of a run (run.json)."""

    run_dir: Path
    run_id: str
    phase: str
    mlflow_run_id: str | None = None
    parent_mlflow_run_id: str | None = None
    status: str = "running"
    extra: dict = field(default_factory=dict)

    def save(self) -> None:
        write_json_atomic(
            self.run_dir / "run.json",
            {
                "run_id": self.run_id,
                "phase": self.phase,
                "mlflow_run_id": self.mlflow_run_id,
                "parent_mlflow_run_id": self.parent_mlflow_run_id,
                "status": self.status,
                "extra": self.extra,
            },
        )


def phase_run_dir(config: RunConfig, phase: str) -> Path:
    """`runs/<name>` for a single flow and the pipeline itself; `runs/<name>/<phase>` for each
    phase of the pipeline."""
    if config.flow == "pipeline" and phase != "pipeline":
        return config.run_dir / phase
    return config.run_dir


def open_run(config: RunConfig, phase: str) -> RunState:
    """Create or reopen the run directory of a phase, locked for this process until `run_phase`
    ends (storage.runlock: a second process gets RunLockedError); write the resolved config."""
    from rlpipe.storage.runlock import acquire_run_lock

    run_dir = phase_run_dir(config, phase)
    acquire_run_lock(run_dir)
    state_path = run_dir / "run.json"
    if state_path.exists():
        saved = read_json(state_path)
        state = RunState(
            run_dir=run_dir,
            run_id=saved["run_id"],
            phase=saved["phase"],
            mlflow_run_id=saved.get("mlflow_run_id"),
            parent_mlflow_run_id=saved.get("parent_mlflow_run_id"),
            status=saved.get("status", "running"),
            extra=saved.get("extra", {}),
        )
    else:
        nested = config.flow == "pipeline" and phase != "pipeline"
        run_id = f"{config.run_name}/{phase}" if nested else config.run_name
        state = RunState(run_dir=run_dir, run_id=run_id, phase=phase)
    write_json_atomic(run_dir / "config.json", config.model_dump(mode="json"))
    state.save()
    return state


@contextmanager
def stage_io(config: RunConfig) -> Iterator[None]:
    """How a phase's stages run: tables queued on one ordered background writer (drained when the
    block ends), stages as Prefect task runs or plain calls (tracking.prefect_task_runs)."""
    from rlpipe.tasks._prefect import stage_task_runs
    from rlpipe.tasks.record import background_writes

    with background_writes(), stage_task_runs(config.tracking.prefect_task_runs):
        yield


def run_phase(state: RunState, tracker, body: Callable[[], dict]) -> dict:
    """Run a phase's body; close its MLflow run and run.json as finished or failed (also on
    SIGTERM, which flows/runner.py turns into an exception); release the run dir's lock."""
    from rlpipe.core.termination import sigterm_is_sticky
    from rlpipe.storage.runlock import release_run_lock

    try:
        try:
            with sigterm_is_sticky():
                result = body()
        except BaseException:
            tracker.end("FAILED")
            state.status = "failed"
            state.save()
            raise
        tracker.end("FINISHED")
        state.status, state.extra = "finished", {**state.extra, **result}
        state.save()
        return result
    finally:
        release_run_lock(state.run_dir)


def resolve_config(config_path: str | None, overrides: list[str] | None, config: dict | None) -> RunConfig:
    """The flow parameters (a TOML path and overrides, or a config dict) → a validated config
    that passed tasks/preflight.py (before the flow writes anything); applies its process-wide
    settings (torch threads)."""
    from rlpipe.core.config import apply_overrides
    from rlpipe.tasks.config import load_config, validate_config
    from rlpipe.tasks.preflight import preflight

    if config is not None:
        resolved = validate_config(apply_overrides(config, list(overrides or [])), "(parameters)")
    elif config_path:
        resolved = load_config(config_path, list(overrides or []))
    else:
        raise ValueError("a flow needs config_path or config")
    preflight(resolved)
    if resolved.threads:
        import torch

        torch.set_num_threads(resolved.threads)
    return resolved


def make_tracker(config: RunConfig, state: RunState, parent_run_id: str | None = None):
    """An MLflow tracker bound to the run (reopened on resume), or a no-op one."""
    if not config.tracking.enabled:
        from rlpipe.storage.tracking import NullTracker

        return NullTracker()
    from rlpipe.storage.tracking import MlflowTracker

    tracker = MlflowTracker.for_runs_root(config.runs_root)
    if state.mlflow_run_id:  # a resumed run keeps logging into its MLflow run
        tracker.run_id = state.mlflow_run_id
        tracker.client.update_run(state.mlflow_run_id, status="RUNNING")
        return tracker
    tracker.start(
        run_name=state.run_id, experiment=config.tracking.experiment, params=config.model_dump(mode="json"),
        tags={"rlpipe.run_dir": str(state.run_dir.resolve()), "rlpipe.phase": state.phase},
        parent=parent_run_id,
    )
    state.mlflow_run_id = tracker.run_id
    state.save()
    tracker.log_artifact(state.run_dir / "config.json")
    return tracker


def registered_model_name(config: RunConfig) -> str:
    return config.tracking.registered_model or config.run_name


def write_run_report(config: RunConfig, run_dirs: list[Path]) -> Path | None:
    """The HTML report at the end of a run; a report failure never fails a finished run."""
    if not config.tracking.report:
        return None
    try:
        from rlpipe.dashboards.report import write_report

        return write_report(run_dirs)
    except Exception as error:  # noqa: BLE001 - the run's tables are the product, the report a view
        print(f"rlpipe: could not write the report for {run_dirs[0]}: {error}")
        return None
