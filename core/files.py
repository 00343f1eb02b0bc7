"""Atomic, durable file writes: the primitives that stored tables (storage/) and checkpoints
(training/) both rest on.

A file is written whole under a temporary name in its destination folder and renamed over the
destination with `os.replace` (atomic on POSIX), so a reader -- or a writer killed with SIGKILL --
only ever sees the old file or the new one. Temporary files are named `.<name>.<pid>.<hex>.tmp`:
hidden, and ending in neither the destination's suffix nor anything a reader globs for; the pid
lets `clean_leftovers` remove only what dead writers left. A rename survives a power cut only
once its folder is fsynced (`fsync_path`, `fsync_written`).

A write that fails for lack of space or another I/O error is reported as OSError(errno, strerror,
path) (`naming_io_errors`), whatever form the library doing the write gave it: torch, safetensors
and Arrow name the errno only in their message, SQLite not at all ("database or disk is full").
`io_error` finds that OSError behind any error, for the one line a failed run ends with.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_TMP_RE = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$")
# how libraries write an errno into a message: Rust's io::Error (safetensors), Arrow's "errno 28"
_ERRNO_IN_TEXT = re.compile(r"Os \{ code: (\d+)|\berrno:? (\d+)", re.IGNORECASE)
_FULL_IN_TEXT = ("database or disk is full", "no space left on device")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def errno_of(error: BaseException) -> int | None:
    """The errno behind an error: an OSError's in its chain, or one a library wrote into its
    message ("Os { code: 28", "errno 28", SQLite's "database or disk is full"); None if none."""
    for current in _chain(error):
        if isinstance(current, OSError) and current.errno:
            return current.errno
        text = str(current)
        if match := _ERRNO_IN_TEXT.search(text):
            return int(match.group(1) or match.group(2))
        if any(full in text.lower() for full in _FULL_IN_TEXT):
            return errno.ENOSPC
    return None


# what a storage failure looks like (a full disk or quota, a failing or read-only device, a file
# over the size limit); a refused connection or a missing file are other errors
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


def io_error(error: BaseException) -> OSError | None:
    """The storage failure (STORAGE_ERRNOS) behind `error`: its OSError (the one that names a
    path, if any does), else one made of the errno a message names (no path known); None when
    `error` is none."""
    found = [e for e in _chain(error) if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS]
    if found:
        return next((e for e in found if e.filename), found[0])
    code = errno_of(error)
    return OSError(code, os.strerror(code)) if code in STORAGE_ERRNOS else None


@contextmanager
def naming_io_errors(path: str | os.PathLike) -> Iterator[None]:
    """An I/O failure raised in the block, in whatever form (see the module docstring), leaves it
    as OSError(errno, strerror, `path`) chained to the original; an OSError that already names
    a file is left as it is, and other errors too."""
    try:
        yield
    except Exception as error:
        if isinstance(error, OSError) and error.filename:
            raise
        code = errno_of(error)
        if code is None:
            raise
        own = isinstance(error, OSError) and error.errno == code and error.strerror
        raise OSError(code, error.strerror if own else os.strerror(code), os.fspath(path)) from error


def temporary_path(dest: Path) -> Path:
    """A fresh hidden temporary name beside `dest`, naming this process (see the module docstring)."""
    return dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def atomic_write(dest: Path, write: Callable[[Path], None], *, durable: bool = True) -> None:
    """Call `write(tmp)` on a temporary file beside `dest`, then rename it over `dest`.

    durable: fsync the file before the rename, so a power cut cannot leave a renamed but
    empty file (a SIGKILL cannot either way), and its folder after it, so the rename itself
    survives a power cut (`fsync_written` covers the folders above, when they are new). Not
    durable: after a power cut the newest rename may be lost, leaving the previous file -- still
    whole; `fsync_written` later makes it durable. A failed write leaves no temporary file, and
    an I/O failure raises OSError(errno, strerror, dest) (`naming_io_errors`).
    """
    with naming_io_errors(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_path(dest)
        try:
            write(tmp)
            if durable:
                fsync_path(tmp)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_path(dest.parent)


def fsync_written(files: list[Path], root: Path) -> None:
    """Make earlier writes durable: fsync each file, then each folder from the file's up to
    `root` (inclusive), each once, so renames and newly made folders survive a power cut.
    A file renamed away since (a later write replaced it) is skipped: its folder still is synced."""
    folders: dict[Path, None] = {}
    root = Path(root)
    for file in files:
        try:
            fsync_path(file)
        except FileNotFoundError:
            pass
        folder = file.parent
        while True:
            folders.setdefault(folder, None)
            if folder == root or folder == folder.parent or root not in folder.parents:
                break
            folder = folder.parent
    for folder in folders:
        fsync_path(folder)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a rename is durable only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_leftovers(folder: Path) -> list[Path]:
    """Delete temporary files in `folder` left by writers that died.

    A temporary file is removed only when the process named in it is gone, so a writer busy
    in another process or thread keeps its file. Writers call this on the folder they write to,
    so a resumed write cleans what the killed one left there.
    """
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.glob(".*.tmp"):
        match = _TMP_RE.match(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
