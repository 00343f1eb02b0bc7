"""Untrusted Python in a sandbox: bubblewrap isolation with resource limits on top.

    result = run_python("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out

What the code sees (bubblewrap, `bwrap`, the OS package; `make setup` installs it where missing):

- a fresh, empty, writable scratch folder (`/scratch`, a size-capped tmpfs, its working folder and
  HOME) and a private `/tmp` of the same size; the program itself read-only at `/sandbox/main.py`;
- read-only `/usr` (and `/bin`, `/lib*` as the host has them) and the interpreter's own prefix,
  nothing else of the host: no home, no run folders, no `/etc`, no `/work`;
- no network (a network namespace of its own with nothing in it, so not even the host's
  127.0.0.1), its own pid, IPC and UTS namespaces, an empty environment, a new session (no
  terminal to write to), and it dies with its parent.

Limits, set inside the sandbox before the program starts (`SandboxLimits`): CPU seconds, address
space (`memory_mb`), processes (RLIMIT_NPROC; run as root, the sandbox runs as `nobody` so the
limit holds), file size, no core dumps; stdout and stderr together are read up to
`output_bytes` (more ends the run, `output_truncated`); `timeout_s` of wall clock ends it
(`timed_out`). Ending a run kills the sandbox's init, which takes every process of its pid
namespace with it: nothing is left behind when `run_python` returns.

Not isolated: CPU and memory bandwidth the code shares with the host, the kernel itself (a kernel
bug is out of scope), and the reward: a program can print whatever it likes, so a verifier must
not trust what it cannot check (envs/code.py reads results behind a per-run nonce).

Where bubblewrap is missing or cannot create namespaces, `run_python` raises `SandboxUnavailable`
with one line saying why, unless `allow_unisolated=True`: then the program runs as a plain child
process with the same CPU, memory and file-size limits, timeout and output cap, and none of the
isolation (`SandboxResult.isolated` is False).
"""

from __future__ import annotations

import functools
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_MAIN = "/sandbox/main.py"
SCRATCH = "/scratch"
NOBODY = "nobody"
_UNISOLATED = '(allow_unisolated=True; the code environment: sandbox = "auto")'

# Runs first inside the sandbox: sets the limits on itself (and drops root), then runs the program
# as __main__ in the same interpreter. Limits are
# set here rather than before bwrap so that the process limit counts the sandbox's own processes
# (per user namespace), not every process of the calling user.
_LAUNCHER = """\
import os, resource, sys
cpu, memory, processes, file_size, uid, gid = (int(v) for v in sys.argv[1:7])
def cap(kind, value):
    resource.setrlimit(kind, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
cap(resource.RLIMIT_AS, memory)
if processes > 0:
    cap(resource.RLIMIT_NPROC, processes)
cap(resource.RLIMIT_FSIZE, file_size)
cap(resource.RLIMIT_CORE, 0)
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
sys.argv = sys.argv[7:]
del os, resource, cpu, memory, processes, file_size, uid, gid, cap
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """Isolation cannot run here (no bubblewrap, or no namespaces) and no fallback was allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run besides its wall-clock timeout and memory."""

    cpu_s: int = 10
    """CPU seconds per process (SIGXCPU, then SIGKILL)."""
    processes: int = 16
    """Processes and threads the sandbox may hold at once (RLIMIT_NPROC; isolated runs only)."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    scratch_mb: int = 64
    """Size of the scratch tmpfs, and of the private /tmp (isolated runs)."""
    output_bytes: int = 1 << 20
    """stdout and stderr read together; more ends the run (output_truncated)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "processes", "file_mb", "scratch_mb", "output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"sandbox limit {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run left.

    exit_code:        the program's exit status (128 + N when signal N killed it, 137 when the
                      sandbox was killed for its timeout or output)
    timed_out:        the wall-clock timeout ended it
    output_truncated: stdout + stderr passed SandboxLimits.output_bytes, which ended it
    isolated:         it ran under bubblewrap (False only with allow_unisolated)
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    output_truncated: bool = False
    isolated: bool = True


def interpreter() -> str:
    """The Python the sandbox runs: the real executable behind this one (a venv's base)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _drop_to() -> tuple[int, int] | None:
    """(uid, gid) the program runs as: `nobody`'s when called as root (root ignores
    RLIMIT_NPROC), else None (the caller's own user, mapped into a user namespace)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(NOBODY)
    except KeyError:
        return (65534, 65534)
    return entry.pw_uid, entry.pw_gid


def _host_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as the host has them: a symlink into /usr, or a read-only bind."""
    args = []
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            args += ["--ro-bind", name, name]
    return args


def _bwrap_args(bwrap: str, python: str, main: Path, as_root: bool, scratch_mb: int) -> list[str]:
    """bubblewrap's command line up to the program: namespaces, read-only system, fresh scratch.

    As root, bubblewrap sets up the sandbox with its own privileges (no user namespace) and the
    launcher drops to `nobody`; otherwise a user namespace maps the caller's user."""
    prefix = str(Path(python).parent.parent)  # the interpreter's install prefix
    args = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", *([] if as_root else ["--unshare-user"]),
            "--die-with-parent", "--new-session",
            "--clearenv", "--setenv", "HOME", SCRATCH, "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr", *_host_links()]
    if not prefix.startswith("/usr/"):  # its parents readable by the dropped user, nothing else in them
        for parent in reversed(Path(prefix).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
    size = str(scratch_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "0777", "--size", size, "--tmpfs", SCRATCH,
             "--perms", "0755", "--dir", str(Path(SANDBOX_MAIN).parent),
             "--ro-bind", str(main), SANDBOX_MAIN, "--chdir", SCRATCH]
    return args


@functools.cache
def isolation_problem(python: str | None = None) -> str | None:
    """None when bubblewrap can isolate here, else one line saying why not (checked once)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("the code sandbox needs bubblewrap (`bwrap`), which is not installed: install it "
                f"(`make setup`, or apt-get/dnf install bubblewrap) or allow unisolated runs {_UNISOLATED}")
    try:
        result = _run("import sys; sys.stdout.write('ok')", python or interpreter(), bwrap,
                      timeout_s=30, memory_mb=512, limits=SandboxLimits(), stdin="")
    except OSError as error:
        return f"bubblewrap cannot start ({error}): fix it or allow unisolated runs {_UNISOLATED}"
    if result.stdout != "ok":
        detail = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
        return (f"bubblewrap cannot create the sandbox here ({detail}): run it where namespaces are "
                "allowed (unprivileged user namespaces, or root with CAP_SYS_ADMIN) or allow "
                f"unisolated runs {_UNISOLATED}")
    return None


def run_python(source: str, *, timeout_s: float, memory_mb: int, stdin: str = "",
               limits: SandboxLimits | None = None, allow_unisolated: bool = False,
               python: str | None = None) -> SandboxResult:
    """Run `source` as a Python program in the sandbox (see the module docstring).

    Raises SandboxUnavailable (one line) where bubblewrap cannot isolate and `allow_unisolated`
    is False; ValueError for a non-positive timeout or memory."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 1:
        raise ValueError(f"memory_mb must be >= 1, got {memory_mb}")
    python = python or interpreter()
    problem = isolation_problem(python)
    if problem is not None and not allow_unisolated:
        raise SandboxUnavailable(problem)
    bwrap = shutil.which("bwrap") if problem is None else None
    return _run(source, python, bwrap, timeout_s=timeout_s, memory_mb=memory_mb,
                limits=limits or SandboxLimits(), stdin=stdin)


def _run(source: str, python: str, bwrap: str | None, *, timeout_s: float, memory_mb: int,
         limits: SandboxLimits, stdin: str) -> SandboxResult:
    """One run: under bubblewrap when `bwrap` is a path, else a plain limited child process."""
    drop = _drop_to() if bwrap else None
    with tempfile.TemporaryDirectory(prefix="rlpipe-sandbox-") as folder:
        home = Path(folder)
        main, given = home / "main.py", home / "stdin"
        main.write_text(source)
        given.write_text(stdin)
        main.chmod(0o644)
        uid, gid = drop or (-1, -1)
        launch = [str(limits.cpu_s), str(memory_mb << 20), str(limits.processes if bwrap else 0),
                  str(limits.file_mb << 20), str(uid), str(gid)]
        if bwrap is None:
            cwd = home / "scratch"
            cwd.mkdir()
            argv = [python, "-I", "-B", "-c", _LAUNCHER, *launch, str(main)]
        else:
            cwd = Path("/")
            argv = [*_bwrap_args(bwrap, python, main, drop is not None, limits.scratch_mb),
                    python, "-I", "-B", "-c", _LAUNCHER, *launch, SANDBOX_MAIN]
        with given.open("rb") as stdin_file:
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    start_new_session=True)
        try:
            return _collect(proc, timeout_s, limits.output_bytes, isolated=bwrap is not None)
        except BaseException:  # interrupted while reading: the sandbox goes with it
            _kill(proc)
            proc.wait()
            raise


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group: bwrap's init goes, and its pid namespace with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _collect(proc: subprocess.Popen, timeout_s: float, cap: int, *, isolated: bool) -> SandboxResult:
    """Read stdout and stderr up to `cap` bytes in all until both close, the timeout or the cap."""
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    total, timed_out, truncated = 0, False, False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
        selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
        grace: float | None = None  # after a kill: how long to wait for the pipes to close
        while selector.get_map():
            now = time.monotonic()
            if grace is None and now >= deadline:
                timed_out = True
                _kill(proc)
                grace = now + 5.0
            if grace is not None and now >= grace:
                break
            for key, _ in selector.select(timeout=max(0.0, (grace or deadline) - now)):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                if grace is None:
                    room = cap - total
                    chunks[key.data].append(data[:room])
                    total += min(len(data), room)
                    if len(data) > room:
                        truncated = True
                        _kill(proc)
                        grace = time.monotonic() + 5.0
    code = None
    if not (timed_out or truncated):  # the pipes closed: the program may still run without them
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if code is None:
        _kill(proc)
        code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()

    def text(name: str) -> str:
        return b"".join(chunks[name]).decode("utf-8", errors="replace")

    return SandboxResult(text("stdout"), text("stderr"), code if code >= 0 else 128 - code,
                         timed_out, truncated, isolated)
