"""A data-parallel rank that lost a peer names it: heartbeats in a real TCPStore (threads of this
process stand in for the ranks), the line the launcher then prints, and a rank that ends with its
launcher (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from rlpipe.core.ports import free_port
from rlpipe.flows.launch import failure_message, lost_peers
from rlpipe.training import peer_watch
from rlpipe.training.peer_watch import PeerWatch, StoreLost, lost_line, still, stopped
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


def test_a_rank_whose_counter_moved_lives():
    assert stopped([3, 5, 7], [4, 5, 7], alive=set(), rank=0) == {1, 2}
    assert stopped([3, 5, 7], [4, 5, 7], alive={2}, rank=0) == {1}
    assert stopped([3, 5, 7], [3, 6, 8], alive=set(), rank=0) == set()


def test_a_counter_that_stands_still_too_long_is_lost():
    last, lost = still({}, {1: 0, 2: 0}, now=10.0, lost_after_s=3)
    assert last == {1: (0, 10.0), 2: (0, 10.0)} and lost == []
    last, lost = still(last, {1: 1, 2: 0}, now=12.0, lost_after_s=3)
    assert last == {1: (1, 12.0), 2: (0, 10.0)} and lost == []
    assert still(last, {1: 2, 2: 0}, now=13.5, lost_after_s=3)[1] == [2]


def test_the_lost_line_names_each_rank_and_where_it_ran():
    assert lost_line([1], {1: "node 1, host h, pid 7"}, 2, 5) == \
        "lost rank 1 (node 1, host h, pid 7) of 2: no heartbeat for 5 s, its process or node died"
    assert lost_line([1, 3], {}, 4, 5).startswith("lost rank 1, rank 3 of 4: no heartbeat for 5 s, their")


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield port, master
    del master


def test_a_rank_that_stops_beating_is_named_and_live_ones_are_not(store):
    port, _ = store
    ranks = [PeerWatch(r, 3, "127.0.0.1", port, beat_s=0.05).start() for r in range(3)]
    try:
        began = time.monotonic()
        assert ranks[0].silent(silent_s=2.0)[0] == []  # every rank beats: answered at once
        assert time.monotonic() - began < 1.5
        ranks[2].close()
        time.sleep(0.2)
        lost, where = ranks[0].silent(silent_s=0.5)
        assert lost == [2]
        assert where[2] == f"node ?, host {os.uname().nodename}, pid {os.getpid()}"
        assert ranks[1].silent(silent_s=0.5)[0] == [2]
    finally:
        for rank in ranks:
            rank.close()


def test_the_watch_calls_out_a_rank_that_stopped_beating_wherever_the_others_are(store):
    port, _ = store
    said: list[str] = []
    watchers = [PeerWatch(0, 3, "127.0.0.1", port, beat_s=0.05, lost_after_s=0.5, on_lost=said.append).start(),
                PeerWatch(1, 3, "127.0.0.1", port, beat_s=0.05, lost_after_s=0.5, on_lost=said.append).start()]
    quiet = PeerWatch(2, 3, "127.0.0.1", port, beat_s=0.05).start()
    try:
        time.sleep(0.3)
        quiet.close()
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        # rank 0 watches every rank, the others rank 0 only: rank 1 says nothing of rank 2
        assert said == [f"lost rank 2 (node ?, host {os.uname().nodename}, pid {os.getpid()}) of 3: no heartbeat "
                        "for 0.5 s, its process or node died"]
    finally:
        for watch in watchers:
            watch.close()


def test_a_lost_store_says_node_0_is_gone():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    said: list[str] = []
    watch = PeerWatch(1, 2, "127.0.0.1", port, beat_s=0.05, on_lost=said.append).start()
    del master
    with pytest.raises(StoreLost, match=f"the launch's store at 127.0.0.1:{port} .* does not answer"):
        watch.silent(silent_s=0.5)
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.close()
    assert len(said) == 1 and said[0].startswith(f"lost node 0: the launch's store at 127.0.0.1:{port} (hosted by")


def test_a_failed_rank_reports_the_lost_peer_to_its_launcher(store, tmp_path, monkeypatch):
    port, _ = store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(peer_watch, "SILENT_S", 0.5)
    dead = PeerWatch(1, 2, "127.0.0.1", port, beat_s=0.05).start()
    dead.close()
    stopped_by_watch: list[str] = []
    peer_watch.start_watch(0, 2, lost_after_s=0.1, on_lost=stopped_by_watch.append)
    try:  # the heartbeat thread would find rank 1 lost too: it keeps quiet while lost_peers says it
        line = lost_peers(RuntimeError("[/src/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"))
    finally:
        peer_watch.stop_watch()
    assert stopped_by_watch == []
    assert line.startswith("lost rank 1 (node ?, host ") and line.endswith(
        "(RuntimeError: Connection closed by peer [127.0.0.1]:4242)")
    assert json.loads((tmp_path / "error.json").read_text())["message"] == line
    failure = ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file=str(tmp_path / "error.json"))
    message = failure_message(ChildFailedError("rlpipe.flows.cli", {0: failure}))
    assert message == f"rank 0 (local rank 0, pid 11) exit code 1: {line}"
    assert lost_peers(RuntimeError("no watch runs")) is None


def test_a_rank_ends_with_its_launcher():
    """A launcher (here a plain process) starts a rank in a session of its own, as torch's does,
    and is SIGKILLed: the rank gets SIGTERM at once."""
    rank = ("from rlpipe.flows.launch import die_with_launcher; import time; die_with_launcher(); "
            "print('ready', flush=True); time.sleep(60)")
    launcher = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
                "start_new_session=True, stdout=subprocess.PIPE, text=True); p.stdout.readline(); "
                "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", launcher, rank], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the rank outlived its launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
        if "pid" in locals() and alive(pid):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: nobody waits for an orphan's exit here but init)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("rank", "code", "stopped"), [(1, 1, ""), (0, 143, "stopped as on SIGTERM\n")])
def test_a_rank_that_lost_a_peer_says_so_and_stops(rank, code, stopped, tmp_path):
    """Rank 0 stops its run as on SIGTERM (here a handler stands in for the run's); another rank
    exits at once."""
    script = ("import signal, sys, time\n"
              "from rlpipe.flows.launch import stop_lost_rank\n"
              "signal.signal(signal.SIGTERM, lambda *_: (print('stopped as on SIGTERM'), sys.exit(143)))\n"
              f"stop_lost_rank({rank})('lost rank 9 of 10')\n"
              "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")})
    assert (done.returncode, done.stdout) == (code, stopped)
    assert done.stderr == f"rlpipe: rank {rank}: lost rank 9 of 10; stopping\n"
    assert json.loads((tmp_path / "error.json").read_text())["message"] == "lost rank 9 of 10"
