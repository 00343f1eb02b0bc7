"""Checkpoint retention (`checkpoint.keep_last`): which checkpoints of a run go, and removing them
so that a kill at any moment leaves either a whole checkpoint or a marked leftover.

    <run_dir>/checkpoints/step_<NNNNNN>/                   a whole checkpoint (training/checkpoint_io.py)
    <run_dir>/checkpoints/.deleting-step_<NNNNNN>-<hex>/   one being removed: hidden, so no reader
                                                           (`latest_checkpoint`, `resume_checkpoint`,
                                                           `checkpoint_steps`) ever sees it

A removal renames the folder to its hidden `.deleting-` name (one atomic rename, fsynced), then
deletes it. A kill before the rename leaves the whole checkpoint; after it, a marked leftover that
`pending_removals` finds and the next retention pass (tasks/checkpoint.py `retain_checkpoints`)
finishes. A resume never picks a half-deleted checkpoint: the rename comes first.

Which go (`removable_steps`): every complete checkpoint but the newest `keep_last`, the pinned ones
(those a registry alias points to) and the newest one (what a resume starts from). Optimizer state
(`optimizer.pt`, the largest file: two fp32 moments per weight for AdamW) is only read by a resume
or a replay continuing from that checkpoint, so `drop_optimizer_state` removes it from every kept
checkpoint but the newest: metadata.json is first rewritten (atomically) without the file and with
`optimizer_dropped` set, then the file is deleted, so `verify_checkpoint` holds at every moment.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.core.files import atomic_write, fsync_path
from rlpipe.training.checkpoint_files import (
    CHECKPOINTS,
    METADATA_FILE,
    OPTIMIZER_FILE,
    checkpoint_dir,
    checkpoint_steps,
)

DELETING = ".deleting-"
DROPPED_KEY = "optimizer_dropped"  # metadata.json: the optimizer state was removed by retention


def removable_steps(steps: Iterable[int], keep_last: int, pinned: Iterable[int] = ()) -> list[int]:
    """The checkpoint steps retention removes: all but the newest `keep_last`, the `pinned` ones and
    the newest (resume's). keep_last = 0 keeps every checkpoint."""
    if keep_last < 0:
        raise ValueError(f"checkpoint.keep_last must be >= 0; got {keep_last}")
    ordered = sorted(set(steps))
    if not keep_last or not ordered:
        return []
    kept = set(ordered[-keep_last:]) | set(pinned) | {ordered[-1]}
    return [step for step in ordered if step not in kept]


def mark_for_removal(path: str | Path) -> Path:
    """Rename a checkpoint folder to its hidden `.deleting-<name>-<hex>` name (fsynced): from now
    on no reader sees it. Returns the new path."""
    path = Path(path)
    marked = path.parent / f"{DELETING}{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, marked)
    fsync_path(path.parent)
    return marked


def marked_step(path: Path) -> int | None:
    """The step of a `.deleting-step_<NNNNNN>-<hex>` folder (None for any other name)."""
    name = path.name
    if not name.startswith(f"{DELETING}step_"):
        return None
    digits = name[len(f"{DELETING}step_"):].rpartition("-")[0]
    return int(digits) if digits.isdigit() else None


def pending_removals(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint marked for removal and not yet gone (a kill fell in
    between), by step."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(step, child) for child in root.iterdir() if (step := marked_step(child)) is not None]
    return sorted(found)


def delete_marked(path: Path) -> None:
    """Delete a folder `mark_for_removal` renamed (whatever of it a killed deletion left)."""
    if marked_step(path) is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint marked for removal ({DELETING}step_...)")
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():  # ignore_errors hid why: raise it
        shutil.rmtree(path)


def drop_optimizer_state(path: str | Path) -> bool:
    """Remove `optimizer.pt` from a whole checkpoint: metadata.json rewritten without it first
    (`optimizer_dropped: true`), then the file deleted. Returns whether anything changed; a
    leftover file that metadata.json no longer lists (a kill in between) is deleted too."""
    path = Path(path)
    metadata_file = path / METADATA_FILE
    metadata = json.loads(metadata_file.read_text())
    files = metadata.get("files") or {}
    changed = False
    if OPTIMIZER_FILE in files or (path / OPTIMIZER_FILE).is_file() and not metadata.get(DROPPED_KEY):
        metadata["files"] = {name: digest for name, digest in files.items() if name != OPTIMIZER_FILE}
        metadata[DROPPED_KEY] = True
        text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
        atomic_write(metadata_file, lambda tmp: Path(tmp).write_text(text))
        changed = True
    if (path / OPTIMIZER_FILE).is_file():
        (path / OPTIMIZER_FILE).unlink()
        fsync_path(path)
        changed = True
    return changed


def optimizer_dropped(path: str | Path) -> bool:
    """Whether retention removed the checkpoint's optimizer state (metadata.json says so)."""
    try:
        return bool(json.loads((Path(path) / METADATA_FILE).read_text()).get(DROPPED_KEY))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Retained:
    """What one retention pass did."""

    removed: list[int] = field(default_factory=list)
    """Steps whose checkpoint was removed (leftovers of a killed pass included)."""
    optimizer_dropped: list[int] = field(default_factory=list)
    """Kept checkpoints whose optimizer state was removed."""


def retain(run_dir: str | Path, keep_last: int, pinned: Iterable[int] = (),
           on_remove: Callable[[int], None] = lambda step: None) -> Retained:
    """One retention pass over `<run_dir>/checkpoints`: finish the removals a kill interrupted,
    mark every `removable_steps` checkpoint, then per marked one call `on_remove(step)` (the
    registry's part) and delete it; last, drop the optimizer state of every kept checkpoint but
    the newest. keep_last = 0 only finishes interrupted removals."""
    pending = pending_removals(run_dir)
    steps = checkpoint_steps(run_dir)
    marked = [(step, mark_for_removal(checkpoint_dir(run_dir, step)))
              for step in removable_steps(steps, keep_last, pinned)]
    for step, path in [*pending, *marked]:
        on_remove(step)
        delete_marked(path)
    kept = sorted(checkpoint_steps(run_dir))
    dropped = [step for step in kept[:-1] if drop_optimizer_state(checkpoint_dir(run_dir, step))] if keep_last else []
    return Retained([step for step, _ in [*pending, *marked]], dropped)
