"""Registered model versions read back from MLflow (storage/tracking.py writes them): a version
named by a models:/NAME@alias or models:/NAME/VERSION URI, and its files: read in place on a
local artifact store (`model_folder`), downloaded otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlpipe.storage.tracking import WEIGHTS_REMOVED_TAG, tracking_client


def registry_uri(runs_root: str | os.PathLike, what: str = "a models:/ URI") -> str:
    """The MLflow registry `models:/` URIs are read from: $MLFLOW_TRACKING_URI, else the runs
    root's own database (which must exist: nothing is created to look); `what` names the reader in
    the one-line ValueError."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    database = Path(runs_root).resolve() / "mlflow.db"
    if not database.is_file():
        raise ValueError(f"no MLflow registry at {database} to read {what} from "
                         "(set MLFLOW_TRACKING_URI, or give a checkpoint folder)")
    return f"sqlite:///{database}"


def model_folder(tracking_uri: str, model_uri: str) -> Path:
    """The folder holding a registered version's files: its artifact folder itself on a local
    store (no copy: storage/model_artifacts.py), else a download. ValueError in one line for a URI
    that does not resolve or a version whose weights retention removed."""
    from rlpipe.storage.model_artifacts import local_artifact_path

    version = resolve_model_version(tracking_client(tracking_uri), model_uri)
    if (removed := version.tags.get(WEIGHTS_REMOVED_TAG)) is not None:
        raise ValueError(f"{model_uri} (version {version.version}) has no weights: {removed}")
    local = local_artifact_path(version.source)
    if local is not None and local.is_dir():
        return local
    return download_model(tracking_uri, model_uri)


def download_model(
    tracking_uri: str, model_uri: str, dst_path: str | os.PathLike | None = None
) -> Path:
    """Files of `models:/NAME@alias` (`@latest` = newest) or `models:/NAME/VERSION` in a local folder.

    Resolves the version with an explicit client: `mlflow.artifacts.download_artifacts` with a
    `registry_uri` argument still reads the process-wide registry (MLflow 3.17).
    """
    import mlflow.artifacts

    client = tracking_client(tracking_uri)
    version = resolve_model_version(client, model_uri)
    if (removed := version.tags.get(WEIGHTS_REMOVED_TAG)) is not None:
        raise ValueError(f"{model_uri} (version {version.version}) has no weights: {removed}")
    path = mlflow.artifacts.download_artifacts(
        artifact_uri=version.source,
        dst_path=None if dst_path is None else str(dst_path),
        tracking_uri=tracking_uri,
    )
    return Path(path)


def resolve_model_version(client: Any, model_uri: str) -> Any:
    """The ModelVersion of `models:/NAME/VERSION`, `models:/NAME@alias` or `models:/NAME@latest`
    (the newest); ValueError naming the URI when it does not resolve."""
    from mlflow.exceptions import MlflowException

    if not model_uri.startswith("models:/"):
        raise ValueError(
            f"model_uri must look like models:/NAME@alias or models:/NAME/VERSION, got {model_uri!r}"
        )
    name, sep, alias = model_uri.removeprefix("models:/").partition("@")
    try:
        if sep and alias == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise ValueError(f"registered model {name!r} has no versions")
            return max(versions, key=lambda v: int(v.version))
        if sep:
            return client.get_model_version_by_alias(name, alias)
        name, _, number = name.partition("/")
        if not number.isdigit():
            raise ValueError(f"{model_uri!r}: want models:/NAME/VERSION (a number) or models:/NAME@alias")
        return client.get_model_version(name, number)
    except MlflowException as error:
        raise ValueError(f"{model_uri} does not resolve: {str(error).splitlines()[0]}") from None

