"""Two torchrun "nodes" on one machine (`--nnodes 2 --node-rank 0|1`, the rendezvous on a
loopback port, gloo), one rank each, sharing the run folder as nodes share a filesystem: a tiny
pipeline whose node 1 is killed mid-run (its launcher SIGKILLed: its rank, in a session of its
own, ends with it) fails on node 0 within seconds, in one line naming the lost rank and the
resume command, and `rlpipe resume` on both nodes finishes it equal to the 2-rank run of one
launcher (conftest.two_rank_run, which test_distributed_run compares with one process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlpipe.core.ports import free_port
from safetensors.torch import load_file

# test_* modules of this folder: pytest puts it on sys.path
from test_distributed_run import OVERRIDES, ROOT, TABLES, TIMEOUT_S, rank_pid
from test_faults import alive
from test_resume import env_for, rows

from tests import warm_cli

pytestmark = pytest.mark.slow
FAILS_WITHIN_S = 120  # train.peer_timeout_s (30 s) at most, then the run's stop on a CPU other work shares


def node(args: list[str], rank: int, port: int, env: dict, cwd: Path) -> subprocess.Popen:
    return warm_cli.Popen([sys.executable, "-m", "rlpipe.flows.cli", *args, "--nproc-per-node", "1", "--nnodes", "2",
                             "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"],
                            env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen) -> str:
    try:
        return process.communicate(timeout=TIMEOUT_S)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_killed_node_fails_the_run_and_resume_on_both_nodes_equals_the_two_rank_run(two_rank_run, tmp_path,
                                                                                    prefect_api_url):
    env, runs = env_for(tmp_path, prefect_api_url), tmp_path / "runs"
    killed = runs / "killed"
    run_args = ["run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=killed",
                *OVERRIDES]
    port = free_port()
    first, second = node(run_args, 0, port, env, tmp_path), node(run_args, 1, port, env, tmp_path)
    trigger = killed / "rl" / "checkpoints" / "step_000002" / "metadata.json"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not trigger.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None and second.poll() is None, "a node ended before the kill point"
        orphan = rank_pid(second.pid, 1)
        assert orphan is not None, "node 1's rank not found among its launcher's children"
        os.killpg(second.pid, signal.SIGKILL)  # node 1's launcher (its rank runs in a session of its own)
        began = time.monotonic()
        stderr = finish(first)
        failed_in = time.monotonic() - began
    finally:
        finish(second)
    assert first.returncode == 1, stderr[-3000:]
    assert failed_in < FAILS_WITHIN_S, f"node 0 took {failed_in:.0f} s to fail"
    assert not alive(orphan), "node 1's rank outlived its launcher"
    failed = [line for line in stderr.splitlines() if line.startswith("rlpipe: data-parallel run failed: rank 0")]
    assert len(failed) == 1, stderr[-3000:]
    # rank 0's next collective fails ("Connection closed by peer") and the heartbeats name the rank
    # within 5 s; or, where rank 0 computes longer than train.peer_timeout_s, its heartbeat thread
    # stops it first (exit 143, the SIGTERM stop)
    assert ": lost rank 1 (node 1, host " in failed[0] and "its process or node died" in failed[0], failed[0]
    assert (f"`rlpipe resume {killed} --nproc-per-node 1 --nnodes 2 --node-rank R --rdzv-endpoint "
            f"127.0.0.1:{port}` on every node") in stderr
    assert json.loads((killed / "run.json").read_text())["status"] == "failed"

    port = free_port()
    resumes = [node(["resume", str(killed)], rank, port, env, tmp_path) for rank in (0, 1)]
    errors = [finish(p) for p in resumes]
    assert [p.returncode for p in resumes] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert json.loads((killed / "run.json").read_text())["status"] == "finished"
    for table in TABLES:
        assert rows(killed, table) == rows(two_rank_run, table), table
    a = load_file(two_rank_run / "rl" / "checkpoints" / "step_000004" / "model.safetensors")
    b = load_file(killed / "rl" / "checkpoints" / "step_000004" / "model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst
