"""The code sandbox (envs/sandbox.py) against hostile programs: each is contained within its
limits, and the host is left as it was (its files untouched, no process of the program left)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from rlpipe.envs import sandbox
from rlpipe.envs.sandbox import SandboxLimits, SandboxUnavailable, isolation_problem, run_python

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
