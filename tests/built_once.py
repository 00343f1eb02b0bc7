"""Expensive test inputs (an SFT checkpoint, a finished run) built once per test session and shared
by every test that only reads them, in both xdist workers.

`build_once(tmp_path_factory, name, build)` returns the folder `name` of this session: the first
caller, in whichever worker, runs `build(folder)` while holding a lock; every later caller waits on
that lock and gets the finished folder. The folders live beside the workers' own temporary folders
(pytest's `pytest-N`, which only this session's processes use), so a session never reuses what
another built, and pytest's rotation of old `pytest-N` folders removes them.

Whoever receives such a folder must not change it: a test that writes (resumes, tampers, rescores
into it) copies it first, `shutil.copytree(folder, tmp_path / ...)`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def session_folder(tmp_path_factory) -> Path:
    """This session's folder for shared inputs: under xdist the parent of the worker's basetemp
    (`pytest-N`, shared by the session's workers), else the basetemp itself."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / "built-once"
    folder.mkdir(exist_ok=True)
    return folder


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The session's folder `name`, made by `build(folder)` (into an empty folder) on first use."""
    root = session_folder(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if build raises
        if not done.exists():
            if folder.exists():  # what a failed build left
                shutil.rmtree(folder)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
