"""A table's snapshot: the one file that says which data files make up the table now.

    tables/<table>/_snapshot.json   {"format": 1, "version": 42,
                                     "fresh":   {"<step>": ["step=<step>/part-0.parquet", ...]},
                                     "merged":  {"steps=0-99/merged-17.parquet": [[0, 99]]},
                                     "retired": {"step=5/part-0.parquet": <unix time it left>}}

Paths are relative to the table folder, so a moved or copied run folder reads as itself. A
writer changes the table by writing its data file(s) first and then replacing this file
atomically (`commit`, under the table's lock); a reader resolves it once (`resolve`) and reads
exactly the files it names. So a reader sees each step whole, as of one commit, never a row
twice, and never a step that an earlier resolve saw go missing: a data file that a compaction or
a rewrite takes out of the snapshot is only `retired`, and stays on disk for
`RETIRED_GRACE_SECONDS` before a later pass deletes it (`swept`), long enough for any query
that resolved an older snapshot to finish.

A step's fresh file and a merged file may hold the same step (a step rewritten after its range
was merged): the fresh one wins, and readers take merged rows of the other steps only
(`TableSnapshot.shadowed`). A table folder without this file (a run written before snapshots)
is read from a listing of its files by the same rules (`listed`), and becomes a snapshot at its
next write or compaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.parquet as pq
from rlpipe.core.files import atomic_write

SNAPSHOT_NAME = "_snapshot.json"
LOCK_NAME = "_snapshot.lock"  # the writers' lock file: no data file, no reader reads it
FORMAT = 1
RETIRED_GRACE_SECONDS = 600.0
"""How long a data file that left the snapshot stays on disk: any query started before it left
has finished by then (a 10,000-step canned query takes well under a second)."""
PART_NAME = "part-0.parquet"
RANGE_PREFIX = "steps="
STEPS_KEY = b"rlpipe.steps"


@dataclass(frozen=True)
class TableSnapshot:
    """The files of one table as of one commit (paths relative to the table folder)."""

    version: int = 0
    fresh: dict[int, tuple[str, ...]] = field(default_factory=dict)  # step -> its files
    merged: dict[str, tuple[int, ...]] = field(default_factory=dict)  # merged file -> its steps
    retired: dict[str, float] = field(default_factory=dict)  # file -> when it left the snapshot

    def steps(self) -> list[int]:
        """Every step the table holds, fresh or merged."""
        return sorted(set(self.fresh).union(*self.merged.values()))

    def shadowed(self) -> set[int]:
        """Steps held both fresh and merged: readers take them from the fresh file."""
        return set(self.fresh) & set().union(*self.merged.values())

    def live(self) -> set[str]:
        return {path for files in self.fresh.values() for path in files} | set(self.merged)


def snapshot_file(folder: Path) -> Path:
    return Path(folder) / SNAPSHOT_NAME


def resolve(folder: Path) -> TableSnapshot:
    """The table's snapshot now: its snapshot file, else a listing (a table written before
    snapshots; an absent folder is an empty table). A snapshot file that a power cut left torn
    (it is fsynced at every durable drain, not at each write) is read as a listing too: fresh
    files win over merged copies, so the rows are the same."""
    path = snapshot_file(folder)
    try:
        return _parse(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return listed(Path(folder))


def _parse(data: dict) -> TableSnapshot:
    if data.get("format") != FORMAT:
        raise ValueError(f"table snapshot format {data.get('format')!r} is not {FORMAT}: a newer rlpipe wrote it")
    return TableSnapshot(
        version=int(data["version"]),
        fresh={int(step): tuple(files) for step, files in data["fresh"].items()},
        merged={path: _expand(ranges) for path, ranges in data["merged"].items()},
        retired={path: float(at) for path, at in data["retired"].items()},
    )


def _dump(snapshot: TableSnapshot) -> str:
    return json.dumps({
        "format": FORMAT, "version": snapshot.version,
        "fresh": {str(step): list(files) for step, files in sorted(snapshot.fresh.items())},
        "merged": {path: _ranges(steps) for path, steps in sorted(snapshot.merged.items())},
        "retired": dict(sorted(snapshot.retired.items())),
    }, separators=(",", ":"))


def _ranges(steps: tuple[int, ...]) -> list[list[int]]:
    """Sorted steps as [first, last] runs: a merged range of 100 steps is one pair."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return runs


def _expand(ranges: list[list[int]]) -> tuple[int, ...]:
    return tuple(step for first, last in ranges for step in range(first, last + 1))


def listed(folder: Path) -> TableSnapshot:
    """A table folder without a snapshot file, as the files on disk make it up: every
    `step=<k>/part-0.parquet` (or its environments' `env=<name>/part-0.parquet`) fresh, every
    `steps=<a>-<b>/merged*.parquet` with the steps its footer lists."""
    fresh: dict[int, list[str]] = {}
    merged: dict[str, tuple[int, ...]] = {}
    if not folder.is_dir():
        return TableSnapshot()
    for file in folder.glob(f"**/{PART_NAME}"):
        step_folder = file.parent.parent if file.parent.name.startswith("env=") else file.parent
        number = step_folder.name.removeprefix("step=")
        if step_folder.name.startswith("step=") and number.isdigit():
            fresh.setdefault(int(number), []).append(file.relative_to(folder).as_posix())
    for file in folder.glob(f"**/{RANGE_PREFIX}*/merged*.parquet"):
        metadata = pq.read_schema(file).metadata or {}
        merged[file.relative_to(folder).as_posix()] = tuple(json.loads(metadata.get(STEPS_KEY, b"[]")))
    return TableSnapshot(fresh={step: tuple(sorted(files)) for step, files in fresh.items()}, merged=merged)


# -- changes: pure functions from one snapshot to the next ------------------------------------

def with_step(snapshot: TableSnapshot, step: int, files: list[str], now: float) -> TableSnapshot:
    """`snapshot` with `step`'s fresh files replaced by `files` (a write or a rewrite); its
    earlier files that `files` does not name are retired."""
    gone = set(snapshot.fresh.get(step, ())) - set(files)
    retired = {path: at for path, at in snapshot.retired.items() if path not in files}
    return replace(snapshot, version=snapshot.version + 1, fresh={**snapshot.fresh, step: tuple(files)},
                   retired={**retired, **{path: now for path in gone}})


def with_merge(snapshot: TableSnapshot, merged: str, steps: list[int], replaces: str | None,
               fresh_merged: list[int], now: float) -> TableSnapshot:
    """`snapshot` with the merged file `merged` (holding `steps`) in place of `replaces` (the
    range's earlier merged file, or None), and the fresh files of `fresh_merged` out; both retired."""
    gone = [path for step in fresh_merged for path in snapshot.fresh.get(step, ())]
    gone += [replaces] if replaces is not None else []
    files = {path: held for path, held in snapshot.merged.items() if path != replaces}
    fresh = {step: paths for step, paths in snapshot.fresh.items() if step not in fresh_merged}
    return replace(snapshot, version=snapshot.version + 1, fresh=fresh, merged={**files, merged: tuple(steps)},
                   retired={**snapshot.retired, **{path: now for path in gone}})


def swept(snapshot: TableSnapshot, now: float, grace: float) -> tuple[TableSnapshot, list[str]]:
    """(`snapshot` less the retired files whose grace is over, those files): the caller deletes
    them once the snapshot without them is committed. A retired path that is live again (a step
    written again at the same path) is never deleted."""
    live = snapshot.live()
    due = sorted(path for path, at in snapshot.retired.items() if now - at >= grace or path in live)
    if not due:
        return snapshot, []
    kept = {path: at for path, at in snapshot.retired.items() if path not in due}
    return replace(snapshot, version=snapshot.version + 1, retired=kept), [p for p in due if p not in live]


# -- commits -----------------------------------------------------------------------------------

@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """The table's writer lock (an flock, per open file: threads of one process exclude each
    other too). Data files are renamed into place and the snapshot committed under it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def commit(folder: Path, change: Callable[[TableSnapshot], TableSnapshot], *, durable: bool) -> Path:
    """Replace the table's snapshot file with `change(current)` atomically (the caller holds
    `locked(folder)`); returns the snapshot file. A table without one starts from its listing."""
    path = snapshot_file(folder)
    text = _dump(change(resolve(folder)))
    atomic_write(path, lambda tmp: Path(tmp).write_text(text), durable=durable)
    return path


def now() -> float:
    return time.time()
