"""The code sandbox (envs/sandbox.py) against programs that reach for the kernel: new namespaces,
shared memory, mounts and ptrace refused by its seccomp filter (envs/seccomp.py), no host path
visible, memory outside the address-space limit bounded, the same filter without bubblewrap, an
unprivileged user's sandbox, and a delegated memory cgroup per run. Hostile programs within its
limits are test_sandbox.py's."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import pytest
from rlpipe.envs import sandbox, sandbox_cgroup, seccomp
from rlpipe.envs.sandbox import SandboxLimits, isolation_problem, run_python

from tests.sandbox_as_nobody import run_as_nobody

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = isolation_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")


def _kernel_probe() -> str:
    """A program that tries what a test program never needs and prints, as JSON, how each try
    ended (an errno name, or "allowed"), and what it can read of paths (/proc)."""
    numbers = {name: calls[0 if platform.machine() in ("x86_64", "amd64") else 1]
               for name, calls in seccomp._CALLS.items()}
    numbers |= {"clone": seccomp._CLONE[0 if platform.machine() in ("x86_64", "amd64") else 1],
                "clone3": seccomp._CLONE3[0 if platform.machine() in ("x86_64", "amd64") else 1]}
    return f"""
import ctypes, errno, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
NR = {numbers!r}
out = {{}}
def tried(name, fn):
    ctypes.set_errno(0)
    try:
        result = fn()
    except OSError as error:
        out[name] = errno.errorcode.get(error.errno, str(error.errno))
        return
    if result == -1:
        out[name] = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    else:
        out[name] = "allowed"
def raw(name, *args):
    return lambda: libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])
def clone(flags):
    pid = libc.syscall(NR["clone"], ctypes.c_long(flags | 17), 0, 0, 0, 0)  # | SIGCHLD
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    return pid
for flag, value in (("user", 0x10000000), ("net", 0x40000000), ("mount", 0x20000), ("pid", 0x20000000),
                    ("ipc", 0x08000000), ("uts", 0x04000000), ("cgroup", 0x02000000)):
    tried("unshare " + flag, lambda: libc.unshare(value))
    tried("clone " + flag, lambda: clone(value))
tried("setns", lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
tried("clone3", raw("clone3", 0, 0))
tried("memfd_create", lambda: os.memfd_create("big"))
tried("memfd_create raw", raw("memfd_create", 0, 0))
tried("shmget", lambda: libc.shmget(0, 512 << 20, 0o1600))
tried("msgget", lambda: libc.msgget(0, 0o1600))
tried("semget", lambda: libc.semget(0, 1, 0o1600))
tried("mq_open", lambda: libc.mq_open(b"/q", 0o100 | 2, 0o600, None))
tried("userfaultfd", raw("userfaultfd", 0))
tried("mount", lambda: libc.mount(b"none", b"/scratch", b"tmpfs", 0, None))
tried("umount2", lambda: libc.umount2(b"/tmp", 2))
tried("chroot", lambda: libc.chroot(b"/scratch"))
tried("pivot_root", raw("pivot_root", 0, 0))
tried("fsopen", raw("fsopen", 0, 0))
tried("open_tree", raw("open_tree", 0, 0, 0))
tried("ptrace", lambda: libc.ptrace(0, 0, None, None))
tried("process_vm_readv", raw("process_vm_readv", 1, 0, 0, 0, 0, 0))
tried("bpf", raw("bpf", 0, 0, 0))
tried("perf_event_open", raw("perf_event_open", 0, 0, -1, -1, 0))
tried("io_uring_setup", raw("io_uring_setup", 1, 0))
tried("keyctl", raw("keyctl", 0, 0))
tried("add_key", raw("add_key", 0, 0, 0, 0, 0))
tried("syslog", raw("syslog", 10, 0, 0))
tried("kcmp", raw("kcmp", 1, 1, 0, 0, 0))
for path in ("/scratch/ok", "/tmp/ok", "/dev/shm/x", "/dev/x", "/x", "/sandbox/x", "/proc/x"):
    tried("write " + path, lambda: open(path, "w").write("x"))
tried("write stdin", lambda: os.write(0, b"x" * (1 << 20)))
tried("grow stdin", lambda: os.ftruncate(0, 1 << 30))
tried("fork", lambda: os.waitpid(os.fork() or os._exit(0), 0)[0])
thread = threading.Thread(target=lambda: None)
tried("thread", thread.start)
thread.join()
seen = []
for path in ("/proc/1/cmdline", "/proc/self/cmdline", "/proc/self/mountinfo", "/proc/1/environ",
             "/proc/self/environ", "/proc/1/cwd", "/proc/self/cgroup"):
    try:
        seen.append(open(path, "rb").read().decode(errors="replace"))
    except OSError:
        pass
for fd in os.listdir("/proc/self/fd"):
    try:
        seen.append(os.readlink("/proc/self/fd/" + fd))
    except OSError:
        pass
out["seen"] = "\\n".join(seen)
print(json.dumps(out))
"""


DENIED = ["unshare user", "unshare net", "unshare mount", "unshare pid", "unshare ipc", "unshare uts",
          "unshare cgroup", "clone user", "clone net", "clone mount", "clone pid", "clone ipc", "clone uts",
          "clone cgroup", "setns", "memfd_create", "memfd_create raw", "shmget", "msgget", "semget", "mq_open",
          "userfaultfd", "mount", "umount2", "chroot", "pivot_root", "fsopen", "open_tree", "ptrace",
          "process_vm_readv", "bpf", "perf_event_open", "io_uring_setup", "keyctl", "add_key", "syslog", "kcmp"]


def _check_kernel_probe(result, hidden: list[str]) -> None:
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert {name: out[name] for name in DENIED} == dict.fromkeys(DENIED, "EPERM")
    assert out["clone3"] == "ENOSYS"  # the C library falls back to clone, whose flags the filter reads
    assert (out["fork"], out["thread"], out["write /scratch/ok"], out["write /tmp/ok"]) == ("allowed",) * 4
    for path in ("/dev/shm/x", "/dev/x", "/x", "/sandbox/x", "/proc/x"):
        assert out["write " + path] != "allowed", path
    assert out["write stdin"] != "allowed" and out["grow stdin"] != "allowed"  # a sealed memory file
    for path in hidden:
        assert path not in out["seen"], f"{path} visible inside: {out['seen']}"


def _host_paths(*more: Path | str) -> list[str]:
    return [str(ROOT), os.getcwd(), f"{tempfile.gettempdir()}/", "rlpipe-sandbox", "rlpipe-run", *map(str, more)]


@needs_bwrap
def test_new_namespaces_memfd_shared_memory_mounts_and_ptrace_are_refused_and_no_host_path_shows(tmp_path):
    result = run_python(_kernel_probe(), timeout_s=30, memory_mb=256)
    _check_kernel_probe(result, _host_paths(tmp_path))


@needs_bwrap
def test_memory_outside_the_address_space_is_bounded():
    """The red-team probes: 512 MiB in a memfd at memory_mb=128, and tmpfs beyond its size."""
    program = """
import os
try:
    fd = os.memfd_create("hog")
    for _ in range(512):
        os.write(fd, b"x" * (1 << 20))
    print("memfd 512 MiB written")
except OSError as error:
    print("memfd refused", error.errno)
written = 0
try:
    with open("/tmp/hog", "wb") as f:
        for _ in range(512):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
except OSError as error:
    print("tmpfs full at", written, "MiB", error.errno)
"""
    result = run_python(program, timeout_s=30, memory_mb=128, limits=SandboxLimits(file_mb=1024, scratch_mb=16))
    assert result.exit_code == 0, result.stderr
    assert "memfd refused 1" in result.stdout  # EPERM
    assert "tmpfs full at 16 MiB 28" in result.stdout or "tmpfs full at 15 MiB 28" in result.stdout
    assert sandbox.memory_cgroup() is not None or "fallback" in sandbox.memory_bound()


def test_the_seccomp_program_is_well_formed_for_both_machines():
    for machine in ("x86_64", "aarch64"):
        program = seccomp.deny_filter(machine)
        assert len(program) % 8 == 0 and 20 < len(program) // 8 < 256
    with pytest.raises(seccomp.SeccompUnsupported, match="riscv"):
        seccomp.deny_filter("riscv64")


def test_unisolated_runs_load_the_same_filter(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    isolation_problem.cache_clear()
    try:
        result = run_python(_kernel_probe(), timeout_s=30, memory_mb=256, allow_unisolated=True)
    finally:
        isolation_problem.cache_clear()
    assert not result.isolated and result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    refused = [name for name in DENIED if not name.startswith(("write", "chroot", "mount", "umount2"))]
    assert {name: out[name] for name in refused} == dict.fromkeys(refused, "EPERM")
    assert out["fork"] == "allowed" and out["thread"] == "allowed"


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_as_an_unprivileged_user_the_user_namespace_sandbox_holds_the_same(tmp_path):
    """Run as another user than root, bubblewrap maps the caller's user in a user namespace, and
    that user owns the sandbox's / and /dev: they are read-only all the same, and nested user
    namespaces are refused."""
    _, (result,) = run_as_nobody([_kernel_probe()])
    _check_kernel_probe(result, _host_paths(tmp_path, "rlpipe-nobody-"))


def test_a_delegated_memory_cgroup_gets_one_cgroup_per_run(monkeypatch, tmp_path):
    """Where RLPIPE_SANDBOX_CGROUP names a folder that delegates memory, each run joins a cgroup
    of its own there before bubblewrap starts, with memory.max = memory_mb + 2 x scratch_mb. (A
    plain folder stands in for cgroupfs: this checks the wiring; the kernel enforces the limit.)"""
    isolation_problem()  # probed already, so the one run below is the only one
    parent = tmp_path / "delegated"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text("cpu memory pids\n")
    monkeypatch.setenv(sandbox_cgroup.CGROUP_ENV, str(parent))
    removed = []
    monkeypatch.setattr(sandbox._RunCgroup, "remove", lambda self: removed.append(self.path))
    sandbox.memory_cgroup.cache_clear()
    try:
        assert sandbox.memory_cgroup() == parent and "cgroup v2" in sandbox.memory_bound()
        if PROBLEM is None:
            result = run_python("print('in')", timeout_s=20, memory_mb=100, limits=SandboxLimits(scratch_mb=10))
            assert (result.stdout, result.memory_cgroup) == ("in\n", True)
            (run,) = removed
            assert run.parent == parent and (run / "memory.max").read_text() == str(120 << 20)
            assert int((run / "cgroup.procs").read_text()) > 0  # the shell that became bwrap joined it
        monkeypatch.setenv(sandbox_cgroup.CGROUP_ENV, str(tmp_path / "missing"))
        sandbox.memory_cgroup.cache_clear()
        problem = sandbox._cgroup_problem()
        assert problem is not None and "\n" not in problem and sandbox_cgroup.CGROUP_ENV in problem
    finally:
        sandbox.memory_cgroup.cache_clear()
