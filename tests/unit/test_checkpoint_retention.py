"""Checkpoint retention (`checkpoint.keep_last`): which checkpoints go, what stays (the pinned and
the newest, with its optimizer state), the registry versions of removed ones retired, and removal
killed at every point (tests/fault_hooks) leaving a whole checkpoint or a marked leftover that the
next pass finishes, never one a resume would pick half-deleted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rlpipe.storage.writer import write_table
from rlpipe.tasks.checkpoint import RegisterOptions, retain_checkpoints
from rlpipe.training.checkpoint_files import (
    checkpoint_dir,
    checkpoint_steps,
    file_hashes,
    resume_checkpoint,
    verify_checkpoint,
)
from rlpipe.training.checkpoint_io import read_optimizer_state
from rlpipe.training.checkpoint_retention import (
    DELETING,
    optimizer_dropped,
    pending_removals,
    removable_steps,
)

HOOKS = Path(__file__).resolve().parents[1] / "fault_hooks"
STEPS = (2, 4, 6, 8)


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint folder `verify_checkpoint` accepts: weights, optimizer state, and metadata.json
    with every file's sha256 (no model: only the folder contract matters here)."""
    folder = checkpoint_dir(run_dir, step)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(os.urandom(64))
    (folder / "optimizer.pt").write_bytes(os.urandom(256))
    every = file_hashes(folder)
    metadata = {"step": step, "policy_version": step, "sha256": every["model.safetensors"],
                "weight_files": {"model.safetensors": every["model.safetensors"]}, "files": every}
    (folder / "metadata.json").write_text(json.dumps(metadata))
    return folder


def fake_run(run_dir: Path, steps=STEPS) -> None:
    """Checkpoints at `steps`, each with its `checkpoints` row naming registered version = step."""
    for step in steps:
        path = fake_checkpoint(run_dir, step)
        write_table(run_dir, "checkpoints", step, [{
            "run_id": "r", "step": step, "policy_version": step, "path": str(path), "sha256": "",
            "mlflow_model_name": "m", "mlflow_model_version": str(step), "created_at": None}], run_id="r")


class Registry:
    """A tracker's registry side: which versions are pinned, which were retired."""

    def __init__(self, pinned=()) -> None:
        self.pinned = {str(v) for v in pinned}
        self.retired: dict[str, str] = {}

    def pinned_versions(self, model_name):
        return self.pinned

    def retire_version(self, model_name, version, reason):
        self.retired[str(version)] = reason


def test_removable_steps_keeps_the_newest_n_the_pinned_and_the_newest():
    assert removable_steps([2, 4, 6, 8], 0) == []  # 0 keeps everything
    assert removable_steps([2, 4, 6, 8], 2) == [2, 4]
    assert removable_steps([2, 4, 6, 8], 1, pinned=[4]) == [2, 6]
    assert removable_steps([8, 2, 2, 6], 5) == []
    assert removable_steps([], 1) == []
    with pytest.raises(ValueError, match="keep_last"):
        removable_steps([1], -1)


def test_keep_last_one_keeps_the_newest_and_best_retires_the_others(tmp_path):
    fake_run(tmp_path)
    registry = Registry(pinned=[4])  # `best` -> version 4 (step 4)
    done = retain_checkpoints(run_dir=tmp_path, tracker=registry, options=RegisterOptions("m", keep_last=1))
    assert checkpoint_steps(tmp_path) == {4, 8}
    assert sorted(done.removed) == [2, 6] and sorted(registry.retired) == ["2", "6"]
    assert "keep_last = 1" in registry.retired["2"]
    assert not pending_removals(tmp_path)
    # the newest keeps its optimizer state (resume's); the pinned one keeps weights only, still whole
    assert done.optimizer_dropped == [4]
    assert (checkpoint_dir(tmp_path, 8) / "optimizer.pt").is_file()
    assert not (checkpoint_dir(tmp_path, 4) / "optimizer.pt").exists() and optimizer_dropped(checkpoint_dir(tmp_path, 4))
    for step in (4, 8):
        verify_checkpoint(checkpoint_dir(tmp_path, step))
    assert resume_checkpoint(tmp_path) == (checkpoint_dir(tmp_path, 8), [])
    with pytest.raises(ValueError, match=r"no optimizer.pt to restore from: checkpoint retention"):
        read_optimizer_state(checkpoint_dir(tmp_path, 4))


def test_keep_last_zero_changes_nothing(tmp_path):
    fake_run(tmp_path)
    registry = Registry()
    done = retain_checkpoints(run_dir=tmp_path, tracker=registry, options=RegisterOptions("m"))
    assert checkpoint_steps(tmp_path) == set(STEPS) and not done.removed and not registry.retired
    assert all((checkpoint_dir(tmp_path, s) / "optimizer.pt").is_file() for s in STEPS)


def test_without_a_registry_only_the_newest_n_stay(tmp_path):
    fake_run(tmp_path)
    retain_checkpoints(run_dir=tmp_path, tracker=None, options=RegisterOptions(None, keep_last=2))
    assert checkpoint_steps(tmp_path) == {6, 8}


CHILD = """
import sys
from rlpipe.training.checkpoint_retention import retain
retain(sys.argv[1], keep_last=2)
"""


@pytest.mark.parametrize("point", [
    "before:*/checkpoints/.deleting-step_000004-*",   # killed before the first rename
    "after:*/checkpoints/.deleting-step_000002-*",    # renamed, not yet deleted
    "during:*/checkpoints/.deleting-step_000004-*",   # half of the files deleted
    "after:*/checkpoints/step_000006/metadata.json",  # optimizer state unlisted, the file still there
])
def test_a_kill_during_removal_leaves_whole_checkpoints_or_marked_leftovers(tmp_path, point):
    fake_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
           "RLPIPE_TEST_KILL": point}
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, timeout=60)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    # every visible checkpoint is whole, and resume picks the newest
    for step in checkpoint_steps(tmp_path):
        verify_checkpoint(checkpoint_dir(tmp_path, step))
    assert resume_checkpoint(tmp_path)[0] == checkpoint_dir(tmp_path, 8)
    leftovers = pending_removals(tmp_path)
    assert all(step not in checkpoint_steps(tmp_path) for step, _ in leftovers)
    # the next pass (a resumed phase runs one first) finishes: leftovers gone, their versions retired
    registry = Registry()
    retain_checkpoints(run_dir=tmp_path, tracker=registry, options=RegisterOptions("m", keep_last=1))
    assert checkpoint_steps(tmp_path) == {8}
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(DELETING)]
    assert {str(step) for step, _ in leftovers} <= set(registry.retired)
    verify_checkpoint(checkpoint_dir(tmp_path, 8))
    assert (checkpoint_dir(tmp_path, 8) / "optimizer.pt").is_file()
