"""How the sandbox starts bubblewrap (envs/sandbox.py): its command line (a read-only root and
/dev, size-capped tmpfs, of the host only what the interpreter needs: envs/sandbox_files.py), and
the seccomp program it loads."""

from __future__ import annotations

import functools
import os
import pwd
import secrets
import subprocess
from pathlib import Path

from rlpipe.envs.sandbox_files import interpreter_mounts
from rlpipe.envs.seccomp import SeccompUnsupported, deny_filter

SANDBOX_MAIN = "/sandbox/main.py"
SCRATCH = "/scratch"


def _host_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin where the host has them as symlinks into /usr (the loader's and
    the libraries' paths go through them); a real folder of these is not mounted, only the files
    envs/sandbox_files.py lists in it."""
    args = []
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), name]
    return args


@functools.cache
def _bwrap_has(option: str, bwrap: str) -> bool:
    """Whether this bubblewrap knows `option` (its --help lists it)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in out.stdout + out.stderr


def _bwrap_args(bwrap: str, python: str, as_root: bool, scratch_mb: int, program_fd: int,
                seccomp_fd: int) -> list[str]:
    """bubblewrap's arguments up to the program: namespaces, the interpreter's files read-only,
    fresh scratch, the seccomp filter from `seccomp_fd` and the program copied from `program_fd`.

    As root, bubblewrap sets up the sandbox with its own privileges (no user namespace) and the
    launcher drops to a user id of the run's own (`_drop_to`); otherwise a user namespace maps the caller's user, and nested user
    namespaces are disabled where this bubblewrap can."""
    user = [] if as_root else ["--unshare-user", *(["--disable-userns"] if _bwrap_has("--disable-userns", bwrap)
                                                   else [])]
    args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", *user, "--die-with-parent", "--new-session",
            "--clearenv", "--setenv", "HOME", SCRATCH, "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8", *_host_links(), *interpreter_mounts(python)]
    size = str(scratch_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "0777", "--size", size, "--tmpfs", SCRATCH,
             "--perms", "0755", "--dir", str(Path(SANDBOX_MAIN).parent),
             "--perms", "0444", "--ro-bind-data", str(program_fd), SANDBOX_MAIN,
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH,
             "--seccomp", str(seccomp_fd)]
    return args


@functools.cache
def _seccomp_program() -> bytes | str:
    """The filter's BPF program, or one line saying why there is none for this machine."""
    try:
        return deny_filter()
    except SeccompUnsupported as error:
        return str(error)


# the user ids runs take as root: far above the ranges systems give to accounts and containers
RUN_UIDS = range(1_900_000_000, 2_000_000_000)


def _drop_to() -> tuple[int, int] | None:
    """(uid, gid) the program runs as: a fresh id of RUN_UIDS when called as root (root ignores
    RLIMIT_NPROC, and a shared id would pool every concurrent run's processes under one limit),
    else None (the caller's own user, mapped into a user namespace)."""
    if os.geteuid() != 0:
        return None
    return (_run_uid(),) * 2


def _run_uid() -> int:
    """A user id of RUN_UIDS that no account has, drawn at random: concurrent runs, in this
    process or another, hold different ids but for a chance of about one in 10^8 per pair."""
    while True:
        uid = RUN_UIDS[secrets.randbelow(len(RUN_UIDS))]
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
