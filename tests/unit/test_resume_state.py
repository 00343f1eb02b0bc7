"""What a resumed run rebuilds from its run directory: the `best` eval behind the `best` alias,
and the exclusive lock that keeps a second process out of a run directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from rlpipe.storage.writer import write_table
from rlpipe.tasks.evaluate import best_accuracy_before


def write_evals(run_dir, step: int, correct: list[bool]) -> None:
    rows = [{"run_id": "r", "step": step, "env": "e", "example_id": str(i), "reward": float(c), "correct": c}
            for i, c in enumerate(correct)]
    write_table(run_dir, "evals", step, rows, run_id="r")


def test_best_is_the_best_checkpointed_eval_up_to_the_resumed_step(tmp_path):
    assert best_accuracy_before(tmp_path, 4, set()) == float("-inf")
    write_evals(tmp_path, 0, [True, False, False, False])   # 0.25 at the start
    write_evals(tmp_path, 2, [True, True, True, False])     # 0.75, checkpointed: the alias moved here
    write_evals(tmp_path, 3, [True, True, True, True])      # 1.0 but no checkpoint: never an alias
    write_evals(tmp_path, 6, [True, True, True, True])      # beyond the resumed step
    assert best_accuracy_before(tmp_path, 4, {2, 4}) == 0.75
    assert best_accuracy_before(tmp_path, 1, {2, 4}) == 0.25
    assert best_accuracy_before(tmp_path, 6, {2, 3, 6}) == 1.0


def other_process_locks(run_dir) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from rlpipe.storage.runlock import acquire_run_lock
        acquire_run_lock({str(run_dir)!r})
        print("locked")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_second_process_cannot_lock_a_locked_run_dir_and_is_told_who_holds_it(tmp_path):
    import os

    from rlpipe.storage.runlock import acquire_run_lock, release_run_lock

    run_dir = tmp_path / "run"
    acquire_run_lock(run_dir)
    acquire_run_lock(run_dir)  # the same process may nest (a pipeline's phases)
    try:
        other = other_process_locks(run_dir)
        assert other.returncode != 0 and "RunLockedError" in other.stderr
        assert f"in use by another process (pid {os.getpid()})" in other.stderr
        release_run_lock(run_dir)
        assert other_process_locks(run_dir).returncode != 0  # still held once
    finally:
        release_run_lock(run_dir)
    assert other_process_locks(run_dir).stdout.strip() == "locked"  # free after the last release


def test_a_lock_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    """The kernel drops a flock when its holder dies: no cleanup code runs after SIGKILL."""
    import signal

    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from rlpipe.storage.runlock import acquire_run_lock
        acquire_run_lock({str(run_dir)!r})
        print("locked", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert "RunLockedError" in other_process_locks(run_dir).stderr  # held while it lives
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=30) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    assert other_process_locks(run_dir).stdout.strip() == "locked"
