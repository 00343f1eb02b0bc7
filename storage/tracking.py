"""Thin MLflow helpers: runs, metrics, checkpoints as registered model versions, aliases.

    tracker = MlflowTracker.for_runs_root("runs")         # sqlite:///runs/mlflow.db, runs/mlartifacts/
    with tracker.start("demo", experiment="rlpipe", params=config_dict):
        tracker.log_metrics({"train/loss": 1.2}, step=1)
        version = tracker.register_checkpoint("runs/demo/checkpoints/step_000010", "demo-model")
        tracker.set_alias("demo-model", "best", version)
    mlflow.artifacts.download_artifacts("models:/demo-model@best")   # the checkpoint's files

One tracker object is one MLflow run; nested runs (a pipeline parent with SFT and RL children)
are separate trackers started with `parent=<parent tracker>.run_id`. `NullTracker` does nothing,
for tests and `tracking = false`. Everything goes through an explicit `MlflowClient`, so the
process-wide `mlflow.set_tracking_uri` state is never touched.

Why not `mlflow.register_model("runs:/<id>/dir")`: in MLflow 3 it fails for a plain artifact
folder (and leaves an empty registered model). A checkpoint is logged as run artifacts and its
folder becomes a model version with `create_model_version(source=<run artifact uri>/<dir>)`.
The alias `latest` is reserved by MLflow: `models:/NAME@latest` already means the newest version.

Several runs may start at once on one SQLite store (a sweep, `rlpipe run` started three times):
MLflow creates a store's tables and runs its migrations on the first use of each of its two
stores (tracking, model registry), and two processes doing that together fail ("table ...
already exists", "duplicate column name"). `tracking_client(uri)` makes both stores under an
exclusive lock on `<database>.lock` beside the database (fcntl.flock: the kernel drops it when
its holder dies), so the first process migrates and the others wait, then find the store made.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

RESERVED_ALIASES = frozenset({"latest"})
WEIGHTS_REMOVED_TAG = "rlpipe.weights_removed"  # a version whose checkpoint retention removed
_MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow's limit on params per log_batch call


def default_tracking_uri(runs_root: str | os.PathLike) -> str:
    """$MLFLOW_TRACKING_URI if set, else `sqlite:///<runs_root>/mlflow.db` (absolute)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(runs_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


# MLflow's metric-logging thread either blocks on its queue for up to a second at a time (the
# default) or, with this set, waits up to that many seconds on its stop event and then logs every
# batch queued meanwhile. Only the second wakes at once when the queue is shut down, so ending a
# run no longer waits out the first's second (a pipeline ends three runs: about 3 s of every
# `rlpipe run` was that wait); it also writes each second's metrics in one transaction.
ASYNC_LOGGING_BUFFER_ENV = "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"


def tracking_client(tracking_uri: str) -> Any:
    """An MlflowClient on `tracking_uri` (tracking and registry) whose stores exist: on a SQLite
    URI, they are made (tables, migrations) under an exclusive file lock, so processes starting
    together do not migrate one database at once (see the module docstring)."""
    from mlflow import MlflowClient  # imported here: mlflow costs ~1 s to import

    os.environ.setdefault(ASYNC_LOGGING_BUFFER_ENV, "1")  # a user's own value stays

    database = Path(tracking_uri[len("sqlite:///"):]) if tracking_uri.startswith("sqlite:///") else None
    if database is None or str(database) in ("", ":memory:"):
        return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    database.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(database.with_name(database.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)  # the tracking store
        client.search_experiments(max_results=1)  # (made lazily by other MLflow versions)
        client.search_registered_models(max_results=1)  # the registry store
    finally:
        os.close(fd)  # closing drops the lock
    return client


def _drain_async_logging(client: Any) -> None:
    """Log every queued metric now and stop MLflow's logging thread (it starts again on the next
    queued batch): what `set_terminated` does first anyway, done before waiting on the queued
    operations so that none of them waits for the thread's next wake-up. A client without that
    store method (another MLflow) keeps the slower path."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    shut_down = getattr(store, "shut_down_async_logging", None)
    if callable(shut_down):
        shut_down()


def default_artifact_root(runs_root: str | os.PathLike) -> str | None:
    """Where new experiments keep artifacts, as a file URI: `mlartifacts` beside the SQLite
    database that holds the runs (`<runs_root>/mlflow.db`, or the file $MLFLOW_TRACKING_URI names),
    never MLflow's default `./mlruns` of whatever folder a command ran in; None when
    $MLFLOW_TRACKING_URI names a server or another store, which decides for itself."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return (Path(runs_root).resolve() / "mlartifacts").as_uri()
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; values as text, cut to MLflow's length limit."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)[:_MAX_PARAM_LENGTH]
    return flat


class Tracker(Protocol):
    """What flows need from experiment tracking. One object tracks one run at a time."""

    run_id: str | None

    def start(
        self,
        run_name: str,
        experiment: str,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        parent: str | None = None,
    ) -> Tracker: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None: ...

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...

    def register_checkpoint(
        self,
        checkpoint_dir: str | os.PathLike,
        model_name: str,
        tags: Mapping[str, str] | None = None,
    ) -> str: ...

    def set_alias(self, model_name: str, alias: str, version: str) -> None: ...

    def pinned_versions(self, model_name: str) -> set[str]: ...

    def retire_version(self, model_name: str, version: str, reason: str) -> None: ...

    def set_lineage_tags(self, tags: Mapping[str, str]) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...

    def __enter__(self) -> Tracker: ...

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None: ...


class _EndOnExit:
    """`with tracker.start(...):` ends the run FINISHED, or FAILED when the block raises."""

    def __enter__(self):
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self.end("FAILED" if kind is not None else "FINISHED")


class NullTracker(_EndOnExit):
    """The tracker of a run with tracking off (and of tests): tracks nothing, registers nothing,
    keeps the metrics it was given in memory so tests can look."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.params: dict[str, str] = {}
        self.status: str | None = None

    def start(self, run_name, experiment, params=None, tags=None, parent=None) -> NullTracker:
        self.run_id = f"null-{run_name}"
        self.params = flatten_params(params or {})
        self.status = "RUNNING"
        return self

    def log_metrics(self, metrics, step) -> None:
        self.metrics.append(
            (step, {key: float(value) for key, value in metrics.items() if value is not None})
        )

    def log_dict(self, data, artifact_file) -> None:
        pass

    def log_artifact(self, path, artifact_path=None) -> None:
        pass

    def register_checkpoint(self, checkpoint_dir, model_name, tags=None) -> None:
        return None  # no registry: checkpoints rows keep a null model version

    def set_alias(self, model_name, alias, version) -> None:
        _check_alias(alias)

    def pinned_versions(self, model_name) -> set[str]:
        return set()  # no registry: no alias pins a checkpoint

    def retire_version(self, model_name, version, reason) -> None:
        pass

    def set_lineage_tags(self, tags) -> None:
        pass

    def end(self, status="FINISHED") -> None:
        self.status = status


class MlflowTracker(_EndOnExit):
    """One MLflow run through an explicit MlflowClient (no global MLflow state)."""

    def __init__(self, tracking_uri: str, artifact_root: str | None = None) -> None:
        """artifact_root: where new experiments keep artifacts (a folder URI); None = MLflow's default."""
        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root
        self.client = tracking_client(tracking_uri)
        self.run_id: str | None = None
        self._pending: list[Any] = []  # async log operations to wait for
        self.lineage_tags: dict[str, str] = {}  # given to every model version it registers

    @classmethod
    def for_runs_root(cls, runs_root: str | os.PathLike) -> MlflowTracker:
        """A tracker on the embedded store under `runs_root` (or $MLFLOW_TRACKING_URI)."""
        return cls(default_tracking_uri(runs_root), default_artifact_root(runs_root))

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = (
            None if self.artifact_root is None else f"{self.artifact_root.rstrip('/')}/{name}"
        )
        return self.client.create_experiment(name, artifact_location=location)

    def start(self, run_name, experiment, params=None, tags=None, parent=None) -> MlflowTracker:
        """Start a run (a child of run id `parent` when given); returns self for `with`."""
        from mlflow.entities import Param

        if self.run_id is not None:
            raise ValueError(
                f"tracker already tracks run {self.run_id}; end it or use another tracker"
            )
        all_tags = dict(tags or {})
        if parent is not None:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(
            self._experiment_id(experiment), run_name=run_name, tags=all_tags
        )
        self.run_id = run.info.run_id
        flat = [Param(key, value) for key, value in flatten_params(params or {}).items()]
        for start in range(0, len(flat), _BATCH):
            self.client.log_batch(self.run_id, params=flat[start : start + _BATCH])
        return self

    def log_metrics(self, metrics, step) -> None:
        """Queue metrics (None values skipped) without waiting for the store."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if value is not None
        ]
        if batch:
            self._pending.append(
                self.client.log_batch(self._active(), metrics=batch, synchronous=False)
            )

    def log_dict(self, data, artifact_file) -> None:
        self.client.log_dict(self._active(), dict(data), artifact_file)

    def log_artifact(self, path, artifact_path=None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self._active(), str(path), artifact_path)
        else:
            self.client.log_artifact(self._active(), str(path), artifact_path)

    def register_checkpoint(self, checkpoint_dir, model_name, tags=None) -> str:
        """Log the folder's model files as artifacts `checkpoints/<folder name>` (hard links to them
        on a local store; never the training state: storage/model_artifacts.py) and make them a new
        version of `model_name` (created if needed). Returns the version number as text.

        Idempotent for a checkpoint whose tags name its `step` and `sha256`: when this MLflow run
        already registered a version of `model_name` with both, that version is returned and
        nothing is logged (a resume completing a registration a kill interrupted)."""
        folder = Path(checkpoint_dir)
        if not folder.is_dir():
            raise ValueError(f"checkpoint_dir is not a folder: {folder}")
        run_id = self._active()
        if (existing := self.registered_version(model_name, dict(tags or {}))) is not None:
            return existing
        artifact_path = f"checkpoints/{folder.name}"
        from rlpipe.storage.model_artifacts import log_model_files

        stored = log_model_files(self.client, run_id, folder, artifact_path)
        if not self.client.search_registered_models(filter_string=f"name = '{model_name}'"):
            self.client.create_registered_model(model_name)
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
        version = self.client.create_model_version(
            model_name, source=source, run_id=run_id, tags={**self.lineage_tags, **dict(tags or {}), **stored}
        )
        return str(version.version)

    def registered_version(self, model_name: str, tags: Mapping[str, str]) -> str | None:
        """The lowest version of `model_name` that this MLflow run registered with the same
        `step` and `sha256` tags as `tags`; None when there is none (or `tags` lacks either)."""
        step, sha256 = tags.get("step"), tags.get("sha256")
        if step is None or sha256 is None:
            return None
        quote = lambda text: str(text).replace("'", "\\'")  # noqa: E731
        if not self.client.search_registered_models(filter_string=f"name = '{quote(model_name)}'"):
            return None
        found = self.client.search_model_versions(
            f"name = '{quote(model_name)}' and run_id = '{self._active()}' and tags.step = '{quote(step)}'")
        versions = [int(v.version) for v in found if v.tags.get("sha256") == sha256]
        return str(min(versions)) if versions else None

    def set_lineage_tags(self, tags) -> None:
        """Tag the run with where it started (`parent_*`: checkpoint, model version) and give the
        same tags to every model version it registers from now on (`rlpipe lineage` reads them)."""
        self.lineage_tags = {key: str(value) for key, value in tags.items() if value is not None}
        for key, value in self.lineage_tags.items():
            self.client.set_tag(self._active(), f"rlpipe.{key}", value)

    def set_alias(self, model_name, alias, version) -> None:
        _check_alias(alias)
        self.client.set_registered_model_alias(model_name, alias, str(version))

    def pinned_versions(self, model_name) -> set[str]:
        """The versions of `model_name` an alias points to, and its newest (`@latest`); none for a
        model not registered."""
        quote = str(model_name).replace("'", "\\'")
        if not self.client.search_registered_models(filter_string=f"name = '{quote}'"):
            return set()
        pinned = {str(v) for v in self.client.get_registered_model(model_name).aliases.values()}
        versions = self.client.search_model_versions(f"name = '{quote}'")
        if versions:
            pinned.add(str(max(int(v.version) for v in versions)))
        return pinned

    def retire_version(self, model_name, version, reason) -> None:
        """A version whose checkpoint was removed: its artifact copy deleted (where the artifact
        store can delete), the version kept with the tag `rlpipe.weights_removed` = `reason`, so its
        number, run, step and lineage tags stay what tables and lineage name. Idempotent."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        found = self.client.get_model_version(model_name, str(version))
        if found.tags.get(WEIGHTS_REMOVED_TAG) is None:
            self.client.set_model_version_tag(model_name, str(version), WEIGHTS_REMOVED_TAG, reason)
        try:
            get_artifact_repository(found.source).delete_artifacts()
        except (NotImplementedError, FileNotFoundError):
            pass  # a store that cannot delete keeps the copy: the tag still says the run's folder is gone

    def end(self, status="FINISHED") -> None:
        """Wait for queued metrics, then close the run with `status` (FINISHED | FAILED | KILLED).
        A queued write that failed closes it FAILED and is raised, as OSError naming the tracking
        store when it was an I/O error (a full disk: SQLite's "database or disk is full")."""
        if self.run_id is None:
            return
        failed: Exception | None = None
        _drain_async_logging(self.client)
        for operation in self._pending:
            try:
                operation.wait()
            except Exception as error:  # noqa: BLE001 - raised below, once the run is closed
                failed = failed or error
        self._pending.clear()
        self.client.set_terminated(self.run_id, status="FAILED" if failed else status)
        self.run_id = None
        if failed is not None:
            from rlpipe.core.files import naming_io_errors

            with naming_io_errors(self.tracking_uri.removeprefix("sqlite:///")):
                raise failed

    def _active(self) -> str:
        if self.run_id is None:
            raise ValueError("no active run: call start() first")
        return self.run_id


def _check_alias(alias: str) -> None:
    if alias in RESERVED_ALIASES:
        raise ValueError(
            f"alias {alias!r} is reserved by MLflow (models:/NAME@latest already resolves to the newest version)"
        )

