"""Untrusted Python in a sandbox: bubblewrap isolation with resource limits on top.

    result = run_python("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out

What the code sees (bubblewrap, `bwrap`, the OS package; `make setup` installs it where missing):

- a fresh, empty, writable scratch folder (`/scratch`, a size-capped tmpfs, its working folder and
  HOME) and a private `/tmp` of the same size; the program itself read-only at `/sandbox/main.py`
  (copied in from a memory file, so no host folder is named anywhere); `/` and `/dev` read-only;
- read-only, what the interpreter needs to run and nothing else of the host
  (envs/sandbox_files.py): its executable, its standard library (site-packages in it covered,
  empty) and the shared libraries they link; no installed package, no venv, no checkout, no
  other file of `/usr`, no home, no run folders, no `/etc`, no `/work`. No host path shows in
  /proc either: bubblewrap reads its options from a descriptor (`--args`), so `/proc/1/cmdline`
  is `bwrap --args N` and the interpreter's command, and stdin is a memory file. The
  interpreter's folders are the host paths the program can learn (they are mounted at their own
  paths, as its compiled-in paths need);
- no network (a network namespace of its own with nothing in it, so not even the host's
  127.0.0.1), its own pid, IPC and UTS namespaces, an empty environment, a new session (no
  terminal to write to), and it dies with its parent;
- a seccomp filter (envs/seccomp.py) that refuses, with EPERM, new namespaces (`unshare`,
  `setns`, `clone` with CLONE_NEW*), memory the address-space limit would not count
  (`memfd_create`, System V shared memory and queues, POSIX queues, `userfaultfd`), mounting,
  `ptrace` and the other calls a test program never needs; run as another user than root,
  bubblewrap's `--disable-userns` too where it has it.

Limits, set inside the sandbox before the program starts (`SandboxLimits`): CPU seconds, address
space (`memory_mb`), processes (RLIMIT_NPROC; run as root, each run takes a user id of its own that no account
and no other run holds, so the limit holds and counts that run's processes alone: the kernel
counts RLIMIT_NPROC per user, and runs sharing `nobody` would share one budget), file size, open files, no locked memory, no core dumps; stdout and stderr together
are read up to `output_bytes` (more ends the run, `output_truncated`); `timeout_s` of wall clock
ends it (`timed_out`). Ending a run kills the sandbox's init, which takes every process of its pid
namespace with it: nothing is left behind when `run_python` returns.

Memory, bounded for real:

- with a cgroup v2 memory controller this process may use (`memory_cgroup()`: the folder named by
  `RLPIPE_SANDBOX_CGROUP`, else this process's own cgroup where it delegates `memory`, else, as
  root, `rlpipe-sandbox` under the cgroup2 root where that delegates it), each run gets a cgroup of
  its own: `memory.max` = `memory_mb` + 2 x `scratch_mb` for everything it holds together (its
  processes, its tmpfs files, kernel buffers), no swap, the whole sandbox killed when it is
  exceeded (`memory.oom.group`), and `pids.max` = `processes` where the pids controller is there;
- without one (this fallback is stated by `memory_bound()`), the bound is the sum of limits the
  kernel enforces per process: each process's address space is at most `memory_mb`, at most
  `processes` of them, files only in the two tmpfs of `scratch_mb` each (`/` and `/dev` are
  read-only), no memfd, System V or POSIX shared memory (the seccomp filter), at most 64 open
  files a process: at most `processes` x `memory_mb` + 2 x `scratch_mb` and the kernel buffers of
  those descriptors.

Not isolated: CPU and memory bandwidth the code shares with the host, the kernel itself (a kernel
bug is out of scope), and the meaning of what the program prints: a verifier must keep its secrets
out of the sandbox and judge values outside it (envs/code.py's checker does).

Where bubblewrap is missing or cannot create namespaces, `run_python` raises `SandboxUnavailable`
with one line saying why, unless `allow_unisolated=True`: then the program runs as a plain child
process with the same CPU, memory, file-size and open-file limits, the same seccomp filter
(loaded with prctl), timeout and output cap, and none of the isolation (`SandboxResult.isolated`
is False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlpipe.envs.sandbox_bwrap import (
    SANDBOX_MAIN,
    _bwrap_args,
    _drop_to,
    _seccomp_program,
)
from rlpipe.envs.sandbox_cgroup import (
    _cgroup_problem,
    _RunCgroup,
    memory_cgroup,
    why_no_memory_cgroup,
)
from rlpipe.envs.sandbox_files import InterpreterUnreadable, interpreter_mounts

_UNISOLATED = '(allow_unisolated=True; the code environment: sandbox = "auto")'

# Runs first inside the sandbox: sets the limits on itself (and drops root), then runs the program
# as __main__ in the same interpreter. Limits are set here rather than before bwrap so that the
# process limit counts the sandbox's own processes (per user namespace), not every process of the
# calling user. An unisolated run also loads the seccomp filter here (its hex is the last limit).
_LAUNCHER = """\
import os, resource, sys
cpu, memory, processes, file_size, files, uid, gid = (int(v) for v in sys.argv[1:8])
seccomp = sys.argv[8]
def cap(kind, value):
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
cap(resource.RLIMIT_AS, memory)
if processes > 0:
    cap(resource.RLIMIT_NPROC, processes)
cap(resource.RLIMIT_FSIZE, file_size)
cap(resource.RLIMIT_NOFILE, files)
cap(resource.RLIMIT_MEMLOCK, 0)
cap(resource.RLIMIT_MSGQUEUE, 0)
cap(resource.RLIMIT_CORE, 0)
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
if seccomp:
    import ctypes
    program = bytes.fromhex(seccomp)
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buffer = ctypes.create_string_buffer(program, len(program))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(Program(len(program) // 8,
                                                                            ctypes.addressof(buffer))), 0, 0):
        raise SystemExit(f"rlpipe sandbox: seccomp filter refused: {os.strerror(ctypes.get_errno())}")
    del ctypes, program, Program, buffer, libc
sys.argv = sys.argv[9:]
del os, resource, cpu, memory, processes, file_size, files, uid, gid, cap, seccomp
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""
OPEN_FILES = 64
_CGROUP_JOIN = 'echo $$ > "$0/cgroup.procs" && exec "$@"'


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
    memory_cgroup:    its memory was bounded by a cgroup of its own (see the module docstring)
    over_memory:      that cgroup's memory limit killed it (the kernel's count, memory.events);
                      without a cgroup an allocation past `memory_mb` is refused to the process
                      instead (ENOMEM; MemoryError in Python), which is the program's own outcome
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    output_truncated: bool = False
    isolated: bool = True
    memory_cgroup: bool = False
    over_memory: bool = False


def interpreter() -> str:
    """The Python the sandbox runs: the real executable behind this one (a venv's base)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def isolation_problem(python: str | None = None) -> str | None:
    """None when bubblewrap can isolate here, else one line saying why not (checked once per
    interpreter; `isolation_problem.cache_clear()` forgets)."""
    return _isolation_problem(python or interpreter())


@functools.cache
def _isolation_problem(python: str) -> str | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("the code sandbox needs bubblewrap (`bwrap`), which is not installed: install it "
                f"(`make setup`, or apt-get/dnf install bubblewrap) or allow unisolated runs {_UNISOLATED}")
    if isinstance(program := _seccomp_program(), str):
        return f"the code sandbox cannot filter system calls here ({program}): allow unisolated runs {_UNISOLATED}"
    if (cgroup := _cgroup_problem()) is not None:
        return cgroup
    try:
        interpreter_mounts(python)
    except InterpreterUnreadable as error:
        return f"the code sandbox cannot list what {python} needs ({error}): allow unisolated runs {_UNISOLATED}"
    try:
        result = _run("import sys; sys.stdout.write('ok')", python, bwrap,
                      timeout_s=30, memory_mb=512, limits=SandboxLimits(), stdin="")
    except OSError as error:
        return f"bubblewrap cannot start ({error}): fix it or allow unisolated runs {_UNISOLATED}"
    if result.stdout != "ok":
        detail = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
        return (f"bubblewrap cannot create the sandbox here ({detail}): run it where namespaces are "
                "allowed (unprivileged user namespaces, or root with CAP_SYS_ADMIN) or allow "
                f"unisolated runs {_UNISOLATED}")
    return None


isolation_problem.cache_clear = _isolation_problem.cache_clear  # type: ignore[attr-defined]


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


# ---- cgroup v2 memory limits ---------------------------------------------------------------------

def memory_bound(limits: SandboxLimits | None = None, memory_mb: int = 256) -> str:
    """How a run's memory is bounded here, in one line."""
    limits = limits or SandboxLimits()
    folder = memory_cgroup()
    if folder is not None:
        return (f"cgroup v2 under {folder}: {memory_mb + 2 * limits.scratch_mb} MiB for everything a run holds "
                "(memory_mb + 2 x scratch_mb), no swap")
    return (f"no cgroup v2 memory controller to use ({why_no_memory_cgroup()}), so the fallback: at most "
            f"{limits.processes} processes of {memory_mb} MiB address space each, 2 x {limits.scratch_mb} MiB of tmpfs files, no memfd or "
            f"shared memory, {OPEN_FILES} open files a process")


def _run(source: str, python: str, bwrap: str | None, *, timeout_s: float, memory_mb: int,
         limits: SandboxLimits, stdin: str) -> SandboxResult:
    """One run: under bubblewrap when `bwrap` is a path, else a plain limited child process."""
    drop = _drop_to() if bwrap else None
    uid, gid = drop or (-1, -1)
    program = _seccomp_program()
    filter_hex = program.hex() if bwrap is None and isinstance(program, bytes) else ""
    launch = [str(limits.cpu_s), str(memory_mb << 20), str(limits.processes if bwrap else 0),
              str(limits.file_mb << 20), str(OPEN_FILES), str(uid), str(gid), filter_hex]
    parent = memory_cgroup() if bwrap else None
    with contextlib.ExitStack() as stack:
        given = stack.enter_context(_memory_file("stdin", stdin.encode()))
        if bwrap is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlpipe-sandbox-")))
            cwd, main = folder / "scratch", folder / "main.py"
            cwd.mkdir()
            main.write_text(source)
            argv, fds = [python, "-I", "-B", "-c", _LAUNCHER, *launch, str(main)], ()
        else:
            code = stack.enter_context(_memory_file("program", source.encode()))
            assert isinstance(program, bytes)
            seccomp = stack.enter_context(_memory_file("seccomp", program))
            options = _bwrap_args(bwrap, python, drop is not None, limits.scratch_mb, code, seccomp)
            listed = stack.enter_context(_memory_file("args", b"".join(a.encode() + b"\0" for a in options)))
            cwd, fds = Path("/"), (code, seccomp, listed)
            argv = [bwrap, "--args", str(listed), python, "-I", "-B", "-c", _LAUNCHER, *launch, SANDBOX_MAIN]
        cgroup = None
        if parent is not None:
            try:
                cgroup = _RunCgroup(parent, (memory_mb + 2 * limits.scratch_mb) << 20, limits.processes)
            except OSError as error:
                raise SandboxUnavailable(f"cannot create the run's memory cgroup under {parent}: {error}") from None
            stack.callback(cgroup.remove)
            argv = ["/bin/sh", "-c", _CGROUP_JOIN, str(cgroup.path), *argv]
        proc = subprocess.Popen(argv, stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, pass_fds=fds,
                                start_new_session=True)
        try:
            result = _collect(proc, timeout_s, limits.output_bytes, isolated=bwrap is not None)
        except BaseException:  # interrupted while reading: the sandbox goes with it
            _kill(proc)
            proc.wait()
            raise
        return dataclasses.replace(result, memory_cgroup=cgroup is not None,
                                   over_memory=cgroup is not None and cgroup.over_memory())


@contextlib.contextmanager
def _memory_file(name: str, data: bytes) -> Iterator[int]:
    """A descriptor of an anonymous memory file holding `data`, at offset 0, closed on exit.
    Nothing on disk, and no path but `/memfd:rlpipe-NAME (deleted)`. Sealed: no one, the program
    it is handed to included, can write, grow or shrink it (stdin is one: a writable memfd would
    be memory outside every limit). (rlpipe's own process may make these: the seccomp filter
    binds only the sandbox.)"""
    fd = os.memfd_create(f"rlpipe-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        yield fd
    finally:
        os.close(fd)


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
