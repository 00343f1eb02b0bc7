"""What every flow does around its stages: the run directory, its state file, tracking, logging.

A run directory holds `config.json` (the resolved config), `run.json` (ids that must survive a
resume: the MLflow run id, the phase status, and the absolute folder it was last opened at),
`tables/`, `checkpoints/` and `catalog.duckdb`. Which folder a flow run acts on is
flows/run_folders.py.
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
                "run_dir": str(self.run_dir.resolve()),
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


def finished_result(run_dir: Path) -> dict | None:
    """The saved result (run.json `extra`) of a run that finished, else None; reads only. Its
    checkpoint is where it lies now when the folder was moved or copied (storage/layout.py)."""
    from rlpipe.storage.layout import relocated

    path = Path(run_dir) / "run.json"
    if not path.is_file():
        return None
    saved = read_json(path)
    if saved.get("status") != "finished":
        return None
    result = dict(saved.get("extra", {}))
    if isinstance(result.get("checkpoint"), str):
        result["checkpoint"] = relocated(result["checkpoint"], run_dir)
    return result


def already_finished(run_dir: Path) -> dict | None:
    """The saved result of a finished run, said in one line, or None: a finished run is left
    untouched (run.json, tables, MLflow) by a resume."""
    done = finished_result(run_dir)
    if done is not None:
        print(f"rlpipe: {run_dir} already finished; left as it is")
    return done


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
    from rlpipe.storage.catalog import refresh_if_moved

    refresh_if_moved(run_dir)  # a moved or copied run's catalog read the old folder's files
    return state


@contextmanager
def stage_io(config: RunConfig) -> Iterator[None]:
    """How a phase's stages run: tables queued on one ordered background writer (drained when the
    block ends), stages as Prefect task runs or plain calls (tracking.prefect_task_runs)."""
    from rlpipe.storage.stage_tables import background_writes
    from rlpipe.tasks._prefect import stage_task_runs

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
            tracker.end("FINISHED")  # may fail (a queued metric write): the phase failed then
        except BaseException:
            mark_failed(state, tracker)
            raise
        state.status, state.extra = "finished", {**state.extra, **result}
        state.save()
        return result
    finally:
        release_run_lock(state.run_dir)


def mark_failed(state: RunState, tracker) -> None:
    """run.json, then the MLflow run, say the phase failed: each tried on its own, so that one
    that cannot be written (a full disk) neither keeps the other from trying nor replaces the
    error that stopped the run (it is said on stderr in one line)."""
    import sys

    from rlpipe.core.files import io_error

    def save() -> None:
        state.status = "failed"
        state.save()

    for what, close in (("run.json", save), ("the MLflow run", lambda: tracker.end("FAILED"))):
        try:
            close()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to raise
            # not print: in a flow, Prefect's log_prints makes it an INFO log, not shown
            sys.stderr.write(f"rlpipe: could not mark {what} failed: {io_error(error) or error}\n")


def resolve_config(config_path: str | None, overrides: list[str] | None, config: dict | None,
                   apply_threads: bool = True) -> RunConfig:
    """The flow parameters (a TOML path and overrides, or a config dict) → a validated config;
    that passed tasks/preflight.py (before the flow writes anything); applies its process-wide
    settings (torch threads) unless apply_threads is false."""
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
    from rlpipe.tasks.setup import with_resolved_compile

    resolved = with_resolved_compile(resolved)  # train.compile unset = auto: logged as what ran
    if resolved.threads and apply_threads:
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
    here = str(state.run_dir.resolve())
    previous = state.mlflow_run_id
    if previous and _mlflow_run_dir(tracker, previous) == here:  # a resumed run keeps its MLflow run
        tracker.run_id = previous
        tracker.client.update_run(previous, status="RUNNING")
        return tracker
    # a new run, or a moved or copied one: its earlier MLflow run records the old folder (or lives
    # in another store), so the folder gets an MLflow run of its own that names the earlier one
    tags = {"rlpipe.run_dir": here, "rlpipe.phase": state.phase}
    if previous:
        tags["rlpipe.continues_mlflow_run"] = previous
    tracker.start(
        run_name=state.run_id, experiment=config.tracking.experiment, params=config.model_dump(mode="json"),
        tags=tags, parent=parent_run_id,
    )
    state.mlflow_run_id = tracker.run_id
    state.save()
    tracker.log_artifact(state.run_dir / "config.json")
    return tracker


def _mlflow_run_dir(tracker, run_id: str) -> str | None:
    """The `rlpipe.run_dir` tag of an MLflow run in the tracker's store (None: no such run)."""
    from mlflow.exceptions import MlflowException

    try:
        return tracker.client.get_run(run_id).data.tags.get("rlpipe.run_dir")
    except MlflowException:
        return None


def code_named_by(config: RunConfig) -> list[str]:
    """The Python code a run's config names (imported by whatever builds its environment or
    filters: resume, rescore): the dataset environment's `reward_module`, the verifiers
    environment's `taskset` (of every `[[task.envs]]` entry), `rl.filter.sample_filter`, `rl.buffer.batch_maker`."""
    named = [str(entry.options[key]) for entry in config.task.entries()
             for key in ("reward_module", "taskset") if entry.options.get(key)]
    return named + [spec for spec in (config.rl.filter.sample_filter, config.rl.buffer.batch_maker) if spec]


def say_code_trusted(command: str, config: RunConfig, run_dir: Path) -> None:
    """One line on stderr naming the code of `run_dir`'s config that `command` will import."""
    import sys

    if named := code_named_by(config):
        print(f"{command}: imports {', '.join(named)} named by {run_dir / 'config.json'} (a run folder's code "
              "runs with your rights: use only run folders you trust)", file=sys.stderr)


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
