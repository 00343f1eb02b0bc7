"""An exclusive lock on a run directory, so two processes never write one run at once.

    acquire_run_lock(run_dir)   # RunLockedError naming the holder's pid if another process has it
    release_run_lock(run_dir)

The lock is `fcntl.flock` on `<run_dir>/.lock`: the kernel drops it when the holder exits, even
after SIGKILL, so a crashed run never leaves a stale lock behind. Within one process it counts
(a pipeline's phases, `rlpipe run` around its flow): only the last release unlocks.

    locked_runs_around(folder)  # [(run dir, pid)] of other processes' runs that hold `folder`,
                                # lie inside it, or that it lies inside: what --overwrite refuses
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

LOCK_NAME = ".lock"
_HELD: dict[str, list[int]] = {}  # resolved run dir -> [fd, count]
_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """The run directory is in use by another process."""


def acquire_run_lock(run_dir: str | os.PathLike) -> None:
    """Lock `run_dir` (made if missing) for this process; RunLockedError if another holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    path = run_dir / LOCK_NAME
    with _GUARD:
        held = _HELD.get(key)
        if held is not None and _same_file(held[0], path):
            held[1] += 1
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(
                f"run directory {str(run_dir)!r} is in use by another process (pid {holder}); "
                "wait for it to finish or stop it before running or resuming this run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if held is not None:  # our lock file was deleted (run dir cleared): the new one counts
            os.close(held[0])
        _HELD[key] = [fd, 1 if held is None else held[1] + 1]


def release_run_lock(run_dir: str | os.PathLike) -> None:
    """Undo one `acquire_run_lock`; the last one unlocks."""
    key = str(Path(run_dir).resolve())
    with _GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[key]
            os.close(held[0])  # closing the descriptor drops the flock


def lock_holder(run_dir: str | os.PathLike) -> str | None:
    """The pid (as text) of another process holding `run_dir`'s lock, else None; never blocks,
    creates nothing, and counts this process's own locks as free."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (or unreadable): nobody can be holding it
        return None
    try:
        with _GUARD:
            held = _HELD.get(str(Path(run_dir).resolve()))
            if held is not None and _same_file(held[0], path):
                return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def locked_runs_around(folder: str | os.PathLike) -> list[tuple[Path, str]]:
    """(run dir, holder pid) of every run that another process holds locked at `folder`, inside
    it, or above it (a run whose runs_root is another run's folder lies inside that run)."""
    folder = Path(folder).resolve()
    candidates = [folder, *folder.parents]
    if folder.is_dir():
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in ("tables", "checkpoints", "mlartifacts")]
            if LOCK_NAME in files and Path(root) != folder:
                candidates.append(Path(root))
    return [(path, pid) for path in candidates if (pid := lock_holder(path)) is not None]


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False
