"""A checkpoint folder's files: where checkpoints live, the sha256 of every file, whether a folder
is whole, and which checkpoint a resuming run starts from (training/checkpoint_io.py writes and
loads them).

    <run_dir>/checkpoints/step_<NNNNNN>/   checkpoint_dir(run_dir, step)
        metadata.json    step, time, metrics, policy_version, sha256 of every other file (`files`)

Every file of a checkpoint (weights, optimizer state, RNG and data state, tokenizer, adapter) is
hashed into metadata.json (`files`), and `verify_checkpoint` checks them all: a truncated or
damaged file is named, never loaded. `resume_checkpoint` is what a resuming run starts from: the
newest checkpoint whose files all match, with any damaged newer one moved aside
(`.corrupt-step_<NNNNNN>-<hex>`, kept for inspection), so the run replays the steps after the
good one instead of failing on the same file at every resume. `checkpoint_steps` and
`latest_checkpoint` see only complete checkpoints: hidden folders (a checkpoint being written)
and folders without metadata.json (written last) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
METADATA_FILE = "metadata.json"
OPTIMIZER_FILE = "optimizer.pt"  # optimizer + scheduler state (training/checkpoint_io.py)


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<NNNNNN>`."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but metadata.json, by path relative to it."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != METADATA_FILE}


def _verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint folder's files; return its metadata. ValueError naming the problem."""
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
    for name in ("config.json", METADATA_FILE):
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no {name}")
    try:
        metadata = json.loads((path / METADATA_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint metadata {str(path / METADATA_FILE)!r} is corrupt: {err}") from err
    files = metadata.get("weight_files")
    if not files:
        raise ValueError(f"checkpoint metadata {str(path / METADATA_FILE)!r} lists no weight files")
    # every file where metadata.json lists them (`files`); the weights alone in older checkpoints
    for name, expected in {**files, **(metadata.get("files") or {})}.items():
        file = path / name
        kind = "weights file" if name in files else "file"
        if not file.is_file():
            raise ValueError(f"checkpoint {str(path)!r} is missing its {kind} {name}")
        actual = sha256_file(file)
        if actual != expected:
            raise ValueError(
                f"{kind} {str(file)!r} is corrupt: sha256 {actual[:12]}… does not match "
                f"{expected[:12]}… recorded in metadata.json"
            )
    return metadata


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check that a checkpoint folder is whole (every file it lists with its sha256); return its
    metadata. ValueError naming the folder or file otherwise."""
    return _verify(Path(path))


def checkpoint_steps(run_dir: str | Path) -> set[int]:
    """Steps of the complete checkpoints under `<run_dir>/checkpoints`."""
    return {int(path.name[len("step_"):]) for path in _complete(run_dir)}


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `<run_dir>/checkpoints`, or None."""
    found = [(int(path.name[len("step_"):]), path) for path in _complete(run_dir)]
    return max(found)[1] if found else None


def resume_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `<run_dir>/checkpoints` whose files all match their sha256
    (None: none), and a line for each damaged newer one, which is moved aside
    (`.corrupt-<folder>-<hex>` beside it) so that the run replays its steps from the good one.
    ValueError naming the folder to remove when a damaged one cannot be moved."""
    notes: list[str] = []
    for _, path in sorted(((int(p.name[len("step_"):]), p) for p in _complete(run_dir)), reverse=True):
        try:
            _verify(path)
            return path, notes
        except ValueError as error:
            aside = path.parent / f".corrupt-{path.name}-{uuid.uuid4().hex[:8]}"
            try:
                os.replace(path, aside)
            except OSError as move:
                raise ValueError(f"{error}; it could not be moved aside ({move}): remove {str(path)!r} "
                                 "and resume again") from None
            notes.append(f"{error}; moved it to {str(aside)!r} and resume from the checkpoint before it")
    return None, notes


def _complete(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: list[Path] = []
    for child in root.iterdir():
        name = child.name
        if not name.startswith("step_") or not child.is_dir() or not (child / METADATA_FILE).is_file():
            continue
        if name[len("step_"):].isdigit():
            found.append(child)
    return found
