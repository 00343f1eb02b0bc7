"""The sandbox's memory bound, where each kind applies (envs/sandbox.py, `memory_bound()`): with a
delegated cgroup v2 memory controller, a run past its cgroup's limit is killed and reported over
memory; without one, the stated fallback holds: no process gets past `memory_mb` of address
space, however it allocates, and none can raise its own limit."""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest
from rlpipe.envs import sandbox, sandbox_bwrap, sandbox_cgroup
from rlpipe.envs.code import tool_reply
from rlpipe.envs.sandbox import SandboxLimits, SandboxResult, isolation_problem, run_python

PROBLEM = isolation_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")

# Four processes that each stay under memory_mb=128 of address space and touch 80 MiB: 320 MiB in
# all, past a cgroup's 128 + 2 x 8 MiB, within the fallback's 16 x 128 MiB.
SPREAD = """
import json, os
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(80 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os._exit(0)
    pids.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]), flush=True)
"""


def test_a_cgroup_reports_a_kill_for_memory_from_its_events(tmp_path):
    """memory.events' oom_kill / oom_group_kill counts are what `over_memory` reads (a plain
    folder stands in for cgroupfs)."""
    run = sandbox_cgroup._RunCgroup(tmp_path, 1 << 20, 4)
    assert not run.over_memory()  # no events file: nothing known, nothing claimed
    (run.path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert not run.over_memory()  # reclaim at the limit, no kill
    (run.path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert run.over_memory()
    killed = SandboxResult("", "", 137, False, memory_cgroup=True, over_memory=True)
    assert tool_reply(killed, 100).endswith("[killed: over its memory limit]")


@needs_bwrap
@pytest.mark.skipif(sandbox.memory_cgroup() is None, reason=f"no delegated cgroup v2 memory controller here "
                    f"({sandbox.memory_bound()})")
def test_past_its_cgroup_limit_a_run_is_killed_and_reported_over_memory():
    result = run_python(SPREAD, timeout_s=60, memory_mb=128, limits=SandboxLimits(scratch_mb=8))
    assert result.memory_cgroup and result.over_memory and result.exit_code == 137, result


@needs_bwrap
@pytest.mark.skipif(sandbox.memory_cgroup() is not None, reason="a cgroup bounds memory here (the test above)")
def test_without_a_cgroup_the_fallback_holds_each_process_to_its_address_space():
    assert "fallback" in sandbox.memory_bound()
    spread = run_python(SPREAD, timeout_s=60, memory_mb=128, limits=SandboxLimits(scratch_mb=8))
    assert spread.exit_code == 0 and json.loads(spread.stdout) == [0, 0, 0, 0], spread  # as stated
    assert not spread.memory_cgroup and not spread.over_memory
    program = """
import errno, json, mmap, os, resource, threading
out = {}
def tried(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except MemoryError:
        out[name] = "MemoryError"
    except OSError as error:
        out[name] = errno.errorcode[error.errno]
    except ValueError as error:
        out[name] = "ValueError"
tried("bytearray", lambda: bytearray(200 << 20))
tried("mmap", lambda: mmap.mmap(-1, 200 << 20))
tried("mmap shared", lambda: mmap.mmap(-1, 200 << 20, flags=mmap.MAP_SHARED))
tried("raise limit", lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 40, 1 << 40)))
blocks = []
def grow():
    while True:
        blocks.append(bytearray(1 << 20))
tried("grow", grow)
blocks.clear()
def child():
    try:
        bytearray(200 << 20)
        os._exit(0)
    except MemoryError:
        os._exit(3)
pid = os.fork()
if pid == 0:
    child()
out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
def thread_hog():
    try:
        bytearray(200 << 20)
        out["thread"] = "allowed"
    except MemoryError:
        out["thread"] = "MemoryError"
thread = threading.Thread(target=thread_hog)
thread.start()
thread.join()
print(json.dumps(out))
"""
    result = run_python(program, timeout_s=60, memory_mb=128)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {"bytearray": "MemoryError", "mmap": "ENOMEM", "mmap shared": "ENOMEM",
                                         "raise limit": "ValueError", "grow": "MemoryError", "child": 3,
                                         "thread": "MemoryError"}


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: runs then take user ids of their own")
def test_concurrent_runs_each_get_the_whole_process_limit():
    """RLIMIT_NPROC counts per user: four runs, each forking four children at once, all succeed
    because each run has a user id of its own (sharing `nobody`, the 16 children plus their
    parents passed one limit of 16 and forks failed with EAGAIN)."""
    hold = SPREAD.replace("os._exit(0)", "import time; time.sleep(1.5); os._exit(0)")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_python(hold, timeout_s=60, memory_mb=128,
                                                     limits=SandboxLimits(scratch_mb=8, processes=6)), range(4)))
    for result in results:
        assert result.exit_code == 0 and json.loads(result.stdout) == [0, 0, 0, 0], result
    uids = {run_python("import os; print(os.getuid())", timeout_s=30, memory_mb=128).stdout for _ in range(3)}
    assert len(uids) == 3 and all(int(uid) in sandbox_bwrap.RUN_UIDS for uid in uids)
