"""The code sandbox (envs/sandbox.py) against hostile programs: each is contained within its
limits, and the host is left as it was (its files untouched, no process of the program left)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from rlpipe.envs import sandbox, sandbox_cgroup, seccomp
from rlpipe.envs.sandbox import SandboxLimits, SandboxUnavailable, isolation_problem, run_python

from tests.sandbox_as_nobody import run_as_nobody

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = isolation_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")


def _tag() -> str:
    return "rlsbx" + uuid.uuid4().hex[:9]


def tagged(tag: str, body: str) -> str:
    """`body` after naming the process `tag` (prctl PR_SET_NAME; children inherit it)."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {tag.encode()!r}, 0, 0, 0)\n{body}"


def processes_named(tag: str) -> list[int]:
    """Host pids whose command name is `tag`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == tag:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def assert_none_left(tag: str) -> None:
    """No process named `tag` (a namespace's teardown may take a moment after the kill)."""
    for _ in range(50):
        if not processes_named(tag):
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {processes_named(tag)}")


@needs_bwrap
def test_a_program_runs_with_its_stdin_and_exit_code():
    result = run_python("import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)", timeout_s=20,
                        memory_mb=256, stdin="hello")
    assert (result.stdout, result.exit_code, result.timed_out, result.isolated) == ("HELLO\n", 3, False, True)
    failed = run_python("1/0", timeout_s=20, memory_mb=256)
    assert failed.exit_code == 1 and "ZeroDivisionError" in failed.stderr


@needs_bwrap
def test_writes_outside_the_scratch_folder_fail_and_the_host_files_stay(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    before = sorted(p.name for p in tmp_path.iterdir())
    targets = [str(victim), str(tmp_path / "new.txt"), "/usr/rlpipe-evil", "/sandbox/main.py", "/rlpipe-evil",
               str(Path(sandbox.interpreter()).parent / "evil")]
    program = f"""
import os
for target in {targets!r}:
    try:
        with open(target, "w") as f:
            f.write("owned")
        print("WROTE", target)
    except OSError as error:
        print("refused", target, type(error).__name__)
with open("/tmp/private.txt", "w") as f:
    f.write("private tmp")
with open("/scratch/mine.txt", "w") as f:
    f.write("scratch is writable")
print("scratch", open("mine.txt").read())
"""
    result = run_python(program, timeout_s=20, memory_mb=256)
    assert result.exit_code == 0, result.stderr
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == len(targets)
    assert "scratch scratch is writable" in result.stdout
    assert victim.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path("/usr/rlpipe-evil").exists()
    assert not (Path(sandbox.interpreter()).parent / "evil").exists()


@needs_bwrap
def test_the_run_folder_and_home_are_not_visible(tmp_path):
    run = tmp_path / "runs" / "secret-run"
    run.mkdir(parents=True)
    (run / "run.json").write_text("TOPSECRET")
    program = f"""
import os
try:
    print(open({str(run / 'run.json')!r}).read())
except OSError as error:
    print("refused", type(error).__name__)
print("root", sorted(os.listdir("/")))
print("home", os.path.expanduser("~"), os.listdir(os.path.expanduser("~")))
print("env", sorted(os.environ))
"""
    result = run_python(program, timeout_s=20, memory_mb=256)
    assert result.exit_code == 0, result.stderr
    assert "TOPSECRET" not in result.stdout and "refused FileNotFoundError" in result.stdout
    root = eval(result.stdout.split("root ", 1)[1].splitlines()[0])  # noqa: S307 - a list we printed
    assert not {"etc", "home", "work", "var", "mnt", "opt"} & set(root)
    assert "home /scratch []" in result.stdout
    assert "env ['HOME', 'LANG', 'PATH', 'PWD']" in result.stdout  # nothing of the host's environment


@needs_bwrap
def test_no_network_not_even_a_listener_on_the_hosts_loopback():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = f"""
import socket
for host in ("127.0.0.1", "1.1.1.1"):
    try:
        socket.create_connection((host, {port}), timeout=2).sendall(b"leak")
        print("CONNECTED", host)
    except OSError as error:
        print("refused", host, type(error).__name__)
"""
    try:
        result = run_python(program, timeout_s=20, memory_mb=256)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert result.exit_code == 0, result.stderr
    assert "CONNECTED" not in result.stdout and result.stdout.count("refused") == 2


@needs_bwrap
def test_a_fork_bomb_is_held_to_the_process_limit_and_leaves_nothing():
    tag = _tag()
    program = tagged(tag, """
import os, time
children = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
    except OSError:
        break
print("forked", children, flush=True)
time.sleep(60)
""")
    result = run_python(program, timeout_s=3, memory_mb=256, limits=SandboxLimits(processes=8))
    assert result.timed_out and result.exit_code == 137
    forked = int(result.stdout.split()[1])
    assert forked < 8  # the limit stopped it, far below the 200 it tried
    assert_none_left(tag)
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@needs_bwrap
def test_a_spinning_fork_bomb_ends_at_the_timeout():
    tag = _tag()
    program = tagged(tag, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    result = run_python(program, timeout_s=2, memory_mb=256, limits=SandboxLimits(processes=8))
    assert result.timed_out
    assert_none_left(tag)


@needs_bwrap
def test_memory_hogs_hit_the_memory_limit():
    at_once = run_python("x = bytearray(2 << 30)", timeout_s=20, memory_mb=256)
    assert at_once.exit_code == 1 and "MemoryError" in at_once.stderr
    growing = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", timeout_s=30,
                         memory_mb=256)
    assert not growing.timed_out and growing.exit_code == 1 and "MemoryError" in growing.stderr


@needs_bwrap
def test_an_infinite_loop_ends_at_the_timeout_or_the_cpu_limit():
    tag = _tag()
    looping = run_python(tagged(tag, "while True:\n    pass"), timeout_s=1, memory_mb=256)
    assert looping.timed_out and looping.exit_code == 137
    assert_none_left(tag)
    cpu = run_python("while True:\n    pass", timeout_s=60, memory_mb=256, limits=SandboxLimits(cpu_s=1))
    assert not cpu.timed_out and cpu.exit_code == 128 + 24  # SIGXCPU


@needs_bwrap
def test_a_program_that_closes_its_output_still_ends_at_the_timeout():
    tag = _tag()
    result = run_python(tagged(tag, "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass"), timeout_s=1,
                        memory_mb=256)
    assert result.timed_out and result.exit_code == 137
    assert_none_left(tag)


@needs_bwrap
def test_an_output_flood_is_cut_at_the_cap():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n    sys.stderr.write('y' * 10)",
                        timeout_s=30, memory_mb=256, limits=SandboxLimits(output_bytes=50_000))
    assert result.output_truncated and not result.timed_out
    assert len(result.stdout) + len(result.stderr) == 50_000


@needs_bwrap
def test_large_files_and_a_full_scratch_or_tmp_are_refused():
    program = """
import os
for name, size in (("big", 8 << 20), ("a", 3 << 20), ("b", 3 << 20), ("c", 3 << 20),
                   ("/tmp/a", 3 << 20), ("/tmp/b", 3 << 20), ("/tmp/c", 3 << 20)):
    try:
        with open(name, "wb") as f:
            f.write(b"x" * size)
        print("wrote", name)
    except OSError as error:
        print("refused", name, error.errno)
        os.remove(name)
"""
    result = run_python(program, timeout_s=20, memory_mb=256, limits=SandboxLimits(file_mb=4, scratch_mb=8))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "refused big 27"  # EFBIG: over the file-size limit
    assert lines[1:4] == ["wrote a", "wrote b", "refused c 28"]  # ENOSPC: scratch full
    assert lines[4:] == ["wrote /tmp/a", "wrote /tmp/b", "refused /tmp/c 28"]  # /tmp is capped alike


@needs_bwrap
def test_processes_left_running_by_the_program_are_ended_with_it():
    tag = _tag()
    program = tagged(tag, """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
print("parent leaves")
""")
    result = run_python(program, timeout_s=20, memory_mb=256)
    assert result.exit_code == 0 and not result.timed_out and result.stdout == "parent leaves\n"
    assert_none_left(tag)


def test_without_bubblewrap_it_refuses_unless_unisolated_runs_are_allowed(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    isolation_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap") as refused:
            run_python("print(1)", timeout_s=20, memory_mb=256)
        assert "\n" not in str(refused.value)
        result = run_python("import sys\nprint(sys.stdin.read())", timeout_s=20, memory_mb=256, stdin="in",
                            allow_unisolated=True)
        assert (result.stdout, result.exit_code, result.isolated) == ("in\n", 0, False)
        hog = run_python("x = bytearray(2 << 30)", timeout_s=20, memory_mb=256, allow_unisolated=True)
        assert "MemoryError" in hog.stderr
        tag = _tag()
        loop = run_python(tagged(tag, "while True:\n    pass"), timeout_s=1, memory_mb=256, allow_unisolated=True)
        assert loop.timed_out
        assert_none_left(tag)
    finally:
        isolation_problem.cache_clear()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("", timeout_s=0, memory_mb=64)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("", timeout_s=1, memory_mb=0)
    with pytest.raises(ValueError, match="processes"):
        SandboxLimits(processes=0)


@needs_bwrap
def test_concurrent_runs_do_not_see_each_other():
    results = {}

    def one(i: int) -> None:
        results[i] = run_python(f"import os\nopen('f', 'w').write('{i}')\nprint(os.listdir('.'), open('f').read())",
                                timeout_s=30, memory_mb=256)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i].stdout for i in range(3)] == [f"['f'] {i}\n" for i in range(3)]


# ---- the kernel surface and memory outside the address-space limit ---------------------------

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
