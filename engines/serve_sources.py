"""What `rlpipe serve MODEL` serves: MODEL may be what a user has at hand, as with vLLM.

    rlpipe serve runs/demo/rl/checkpoints/step_000100   a checkpoint folder (verified by its sha256)
    rlpipe serve runs/demo                               a run folder: its newest checkpoint (RL's, for
                                                         a pipeline: then SFT's, then pretrain's)
    rlpipe serve /models/Qwen3-0.6B                      a Hugging Face model folder (config.json,
                                                         weights, tokenizer)
    rlpipe serve Qwen/Qwen3-0.6B[@REVISION]              a hub id: its snapshot in the Hugging Face
                                                         cache, downloaded when missing (not under
                                                         HF_HUB_OFFLINE=1)
    rlpipe serve models:/rlpipe-demo@best                a registered version (also models:/NAME/N,
                                                         @latest) of the registry under --runs-root
                                                         or $MLFLOW_TRACKING_URI: its artifact folder
                                                         read in place on a local store

A checkpoint keeps its policy_version (metadata.json); a plain model is served as policy version
0. A registered version is the checkpoint's model without its training state
(docs/DESIGN.md, "Checkpoints"), served with its policy_version. A folder that is none of these, or a run folder with no checkpoint yet, is refused in one line
naming it and what was looked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.training.checkpoint_files import METADATA_FILE, latest_checkpoint

RUN_PHASES = ("rl", "sft", "pretrain")
"""A pipeline folder's phases, the one whose newest checkpoint is served first."""


@dataclass(frozen=True)
class ServedSource:
    """The folder MODEL resolved to, and what it is."""

    path: Path
    kind: str
    """checkpoint | run | registry | model (a Hugging Face folder) | hub"""

    @property
    def is_checkpoint(self) -> bool:
        return self.kind in ("checkpoint", "run", "registry")


def newest_run_checkpoint(folder: Path) -> Path | None:
    """The newest whole checkpoint of a run folder (`checkpoints/step_N`), or of a pipeline folder's
    first phase that has one (RUN_PHASES order); None when there is none."""
    if (found := latest_checkpoint(folder)) is not None:
        return found
    for phase in RUN_PHASES:
        if (folder / phase).is_dir() and (found := latest_checkpoint(folder / phase)) is not None:
            return found
    return None


def is_run_folder(folder: Path) -> bool:
    return (folder / "run.json").is_file() or (folder / "checkpoints").is_dir() \
        or any((folder / phase / "run.json").is_file() for phase in RUN_PHASES)


def served_source(spec: str | Path, runs_root: str | Path = "runs") -> ServedSource:
    """The folder `spec` names (see the module docstring; `runs_root` holds the registry of a
    models:/ URI); ValueError with one line otherwise."""
    from rlpipe.models.loading import hub_id, resolve_model_path

    text = str(spec)
    if text.startswith("models:/"):
        from rlpipe.storage.model_versions import model_folder, registry_uri

        return ServedSource(model_folder(registry_uri(runs_root, "a models:/ model"), text), "registry")
    folder = Path(text).expanduser()
    if folder.is_dir():
        if (folder / METADATA_FILE).is_file():
            return ServedSource(folder, "checkpoint")
        if is_run_folder(folder):
            newest = newest_run_checkpoint(folder)
            if newest is None:
                raise ValueError(f"run folder {text!r} has no checkpoint yet (looked in checkpoints/ and "
                                 f"{', '.join(p + '/checkpoints/' for p in RUN_PHASES)})")
            return ServedSource(newest, "run")
        if (folder / "config.json").is_file():
            return ServedSource(folder, "model")
        raise ValueError(f"{text!r} is not a checkpoint (metadata.json), a run folder (run.json, checkpoints/) "
                         "or a Hugging Face model folder (config.json)")
    if hub_id(text) is None:
        raise ValueError(f"model {text!r} does not exist: give a checkpoint, a run folder, a Hugging Face "
                         "model folder or a hub id ORG/NAME[@REVISION]")
    return ServedSource(resolve_model_path(text), "hub")
