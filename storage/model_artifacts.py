"""What a registered model version holds, and how it gets there without a second copy.

A checkpoint folder holds the model (weights, config, tokenizer, generation config, LoRA adapter,
an explicit lm_head) and the training state a resume needs (`optimizer.pt`, `rng_state.pt`,
`data_state.json`). A registered version is the model only: the training state never goes to
MLflow (a 0.6B model's optimizer state is about twice its weights), and `metadata.json` is
rewritten for the version so that it lists only the files the version has, names the files left
out and the run folder checkpoint that has them (`resume_from`).

On a local artifact store (a file URI: the default `<runs_root>/mlartifacts`) the version's files
are hard links to the checkpoint's: no byte is written twice, and a checkpoint removed by
retention loses its version's links with it (`retire_version`). Where a link is refused (another
filesystem, a filesystem without links) the file is copied, and the version's tag says so. On a
remote artifact store (an MLflow server) the files are uploaded: a copy is the point there.

    staged = link_model_files(checkpoint, dest)   # dest: a new folder; returns bytes linked / copied
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

TRAINING_STATE_FILES = ("optimizer.pt", "rng_state.pt", "data_state.json")
"""A checkpoint's files a resume needs and a registered version leaves out (their names are those
training/checkpoint_io.py writes)."""
METADATA_FILE = "metadata.json"
ARTIFACT_FILES_TAG = "rlpipe.artifact_files"  # linked | copied | uploaded
LEFT_OUT_TAG = "rlpipe.left_out"  # the training state files the version does not hold


@dataclass(frozen=True)
class Staged:
    """What `link_model_files` made."""

    linked: int = 0
    """Bytes hard-linked to the checkpoint's files (no space of their own)."""
    copied: int = 0
    """Bytes of the checkpoint's files copied (a link was refused)."""
    written: int = 0
    """Bytes written anew: the version's metadata.json."""
    left_out: tuple[str, ...] = ()
    """The checkpoint's training state files the version does not hold."""

    @property
    def how(self) -> str:
        """`linked` when every file is a link, else `copied` (the ARTIFACT_FILES_TAG value)."""
        return "copied" if self.copied else "linked"


def model_files(folder: Path) -> list[str]:
    """A checkpoint's files a registered version holds, relative to `folder`: every file but the
    training state, metadata.json (rewritten, `version_metadata`) and hidden files."""
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if not path.is_file() or relative in (*TRAINING_STATE_FILES, METADATA_FILE) \
                or any(part.startswith(".") for part in Path(relative).parts):
            continue
        found.append(relative)
    return found


def version_metadata(folder: Path, kept: list[str], left_out: list[str]) -> dict | None:
    """The checkpoint's metadata.json for a version holding the files `kept`: `files` cut to them,
    `left_out` and `resume_from` (the checkpoint folder) added; None for a folder without one."""
    source = folder / METADATA_FILE
    if not source.is_file():
        return None
    metadata = json.loads(source.read_text())
    metadata["files"] = {name: digest for name, digest in (metadata.get("files") or {}).items() if name in kept}
    metadata["left_out"] = left_out
    metadata["resume_from"] = str(folder.resolve())
    return metadata


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` at `dst`; copy it where the filesystem refuses a link. True when linked."""
    try:
        os.link(src, dst)
        return True
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    shutil.copyfile(src, dst)
    return False


def link_model_files(folder: str | os.PathLike, dest: str | os.PathLike) -> Staged:
    """Make `dest` (it must not exist) hold the registered version's files of the checkpoint
    `folder`: hard links (copies where refused) and the rewritten metadata.json. Built in a hidden
    folder beside `dest` and renamed into place, so `dest` is whole or absent."""
    folder, dest = Path(folder), Path(dest)
    kept = model_files(folder)
    left_out = [name for name in TRAINING_STATE_FILES if (folder / name).is_file()]
    temporary = dest.parent / f".{dest.name}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir(parents=True)
    linked = copied = written = 0
    try:
        for name in kept:
            target = temporary / name
            target.parent.mkdir(parents=True, exist_ok=True)
            size = (folder / name).stat().st_size
            if _link_or_copy(folder / name, target):
                linked += size
            else:
                copied += size
        if (metadata := version_metadata(folder, kept, left_out)) is not None:
            text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
            (temporary / METADATA_FILE).write_text(text)
            written = len(text.encode())
        os.rename(temporary, dest)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Staged(linked, copied, written, tuple(left_out))


def local_artifact_path(artifact_uri: str) -> Path | None:
    """The folder of a local (file URI or plain path) artifact location; None for a remote store."""
    if artifact_uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(artifact_uri).path))
    if "://" not in artifact_uri and ":" not in artifact_uri.split("/")[0]:
        return Path(artifact_uri)
    return None


def artifact_bytes(artifact_dirs: list[Path], run_dir: Path) -> dict[str, int]:
    """Bytes under MLflow artifact folders: `linked` (hard links to files under `run_dir`: no space
    of their own), `own` (everything else) and `total`."""
    inodes = set()
    for folder, _, files in os.walk(run_dir):
        for name in files:
            try:
                stat = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if stat.st_nlink > 1:
                inodes.add((stat.st_dev, stat.st_ino))
    sizes = {"linked": 0, "own": 0}
    seen = set()
    for root in artifact_dirs:
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    stat = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                key = (stat.st_dev, stat.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                sizes["linked" if key in inodes else "own"] += stat.st_size
    return {**sizes, "total": sizes["linked"] + sizes["own"]}


def log_model_files(client, run_id: str, folder: Path, artifact_path: str) -> dict[str, str]:
    """The checkpoint `folder`'s model files (never its training state) as the MLflow run's
    artifacts at `artifact_path`: hard links on a local store, an upload to a remote one. Returns
    the version's tags saying which (ARTIFACT_FILES_TAG) and what is left out (LEFT_OUT_TAG)."""
    local = local_artifact_path(client.get_run(run_id).info.artifact_uri.rstrip("/"))
    if local is not None:
        dest = local / artifact_path
        if dest.exists():  # an attempt a kill interrupted before its version was made
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = link_model_files(folder, dest)
        how = staged.how
    else:  # staged as links beside the checkpoint (no bytes), then uploaded
        staging = folder.parent / f".upload-{folder.name}-{uuid.uuid4().hex[:8]}"
        try:
            staged, how = link_model_files(folder, staging), "uploaded"
            client.log_artifacts(run_id, str(staging), artifact_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {ARTIFACT_FILES_TAG: how, LEFT_OUT_TAG: " ".join(staged.left_out)}
