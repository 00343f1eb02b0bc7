"""The sandbox's memory bound through cgroup v2 (envs/sandbox.py): where a memory controller is
delegated (RLPIPE_SANDBOX_CGROUP, this process's own cgroup, or as root a folder under the cgroup2
root), each sandboxed run gets a cgroup of its own with memory.max, no swap, oom.group and
pids.max; where none is, the sandbox's stated fallback applies."""

from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

CGROUP_ENV = "RLPIPE_SANDBOX_CGROUP"


def _cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a hybrid host)."""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ", 1)
            if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
                return Path(fields[0].split()[4])
    except OSError:
        pass
    return None


def _own_cgroup(mount: Path) -> Path | None:
    """This process's cgroup v2 folder under `mount` (the `0::` line of /proc/self/cgroup)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return mount / line[3:].lstrip("/")
    except OSError:
        pass
    return None


def _delegates_memory(folder: Path) -> bool:
    """Whether new cgroups under `folder` get a memory controller and this process may make them."""
    try:
        controllers = (folder / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return "memory" in controllers and os.access(folder, os.W_OK)


@functools.cache
def memory_cgroup() -> Path | None:
    """The cgroup v2 folder under which each run gets a memory-limited cgroup of its own, or None
    (the stated fallback, `memory_bound()`). Checked once: `RLPIPE_SANDBOX_CGROUP` (which must
    delegate memory: `_cgroup_problem` refuses it otherwise), else this process's own cgroup where
    it delegates memory, else, run as root, `rlpipe-sandbox` under the cgroup2 root where the root
    delegates memory (created, with memory and pids enabled for its children)."""
    named = os.environ.get(CGROUP_ENV)
    if named:
        return Path(named) if _delegates_memory(Path(named)) else None
    mount = _cgroup2_mount()
    if mount is None:
        return None
    own = _own_cgroup(mount)
    if own is not None and _delegates_memory(own):
        return own
    if os.geteuid() == 0 and _delegates_memory(mount):
        ours = mount / "rlpipe-sandbox"
        try:
            ours.mkdir(exist_ok=True)
            wanted = {"memory", "pids"} & set((mount / "cgroup.subtree_control").read_text().split())
            (ours / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
        except OSError:
            return None
        return ours if _delegates_memory(ours) else None
    return None


def why_no_memory_cgroup() -> str:
    """Why `memory_cgroup()` found none here, in a few words (for `memory_bound()`)."""
    if os.environ.get(CGROUP_ENV):
        return f"{CGROUP_ENV} does not delegate memory"
    mount = _cgroup2_mount()
    if mount is None:
        return "no cgroup2 hierarchy is mounted"
    try:
        controllers = (mount / "cgroup.controllers").read_text().split()
    except OSError:
        controllers = []
    if "memory" not in controllers:
        return (f"the cgroup2 hierarchy at {mount} has the controllers {' '.join(controllers) or 'none'}: "
                "memory is not one of them (it is on a cgroup v1 hierarchy, or off)")
    return "neither this process's cgroup nor, as root, the cgroup2 root delegates memory to it"


def _cgroup_problem() -> str | None:
    """One line when `RLPIPE_SANDBOX_CGROUP` names a folder that cannot take the runs' cgroups."""
    named = os.environ.get(CGROUP_ENV)
    if named and memory_cgroup() is None:
        return (f"{CGROUP_ENV}={named} is not a cgroup v2 folder this process may create cgroups in with "
                "the memory controller (its cgroup.subtree_control must list memory): fix it or unset it")
    return None


class _RunCgroup:
    """A run's own cgroup under `memory_cgroup()`, removed (its processes killed) on exit."""

    def __init__(self, parent: Path, memory_bytes: int, processes: int) -> None:
        self.path = parent / f"rlpipe-run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        try:
            (self.path / "memory.max").write_text(str(memory_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1"), ("pids.max", str(processes))):
                if (self.path / name).exists():
                    (self.path / name).write_text(value)
        except OSError:
            self.remove()
            raise

    def over_memory(self) -> bool:
        """Whether the kernel killed a process of it for memory (`memory.events`: oom_kill or
        oom_group_kill above 0)."""
        try:
            lines = (self.path / "memory.events").read_text().splitlines()
        except OSError:
            return False
        counts = dict(line.split(None, 1) for line in lines if " " in line)
        return any(int(counts.get(name, "0")) > 0 for name in ("oom_kill", "oom_group_kill"))

    def remove(self) -> None:
        """Kill what is left in it and remove it (a namespace's teardown may take a moment)."""
        kill = self.path / "cgroup.kill"
        for attempt in range(50):
            try:
                if kill.exists():
                    kill.write_text("1")
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt == 49:
                    return  # an empty cgroup left behind is harmless; the next cleanup may take it
                time.sleep(0.05)

