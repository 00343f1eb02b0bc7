"""Which ranks of a data-parallel run still live, so a failed collective names the rank it lost.

    watch = start_watch(env.rank, env.world_size, lost_after_s, on_lost)   # every rank, after init_process_group
    lost, where = watch.silent()     # after a failure: the ranks that stopped beating, where they ran
    watch.close()

A gloo collective whose peer process died fails at once, with "Connection closed by peer
[ADDRESS]:PORT": an address, not a rank, and every rank of a machine shares it. So each rank beats
a counter in the launch's store (torchrun's MASTER_ADDR:MASTER_PORT: the TCPStore the launcher of
node 0 hosts, which every rank's process group already uses) once per `BEAT_S`, from a thread
of its own, and says where it runs (`rlpipe/where/RANK`: its node, host and pid). After a
failure, `silent` watches the counters for up to `SILENT_S`: a rank whose counter moves lives;
the others are named as lost. A rank's thread keeps beating while its main thread waits in a
collective or computes (neither holds the GIL for long), so only a dead process, or one cut off
from node 0, falls silent.

Where the store itself cannot be reached (node 0, which hosts it, is gone), `silent` says so
(`StoreLost`). Nothing here is persisted.

The same thread also watches, so a lost rank is noticed wherever the others are, not only at
their next collective (rank 0 may generate for minutes between two): rank 0 reads every rank's
counter each beat, the other ranks rank 0's; a counter that has not moved for `lost_after_s`
(train.peer_timeout_s), or a store that stopped answering, calls `on_lost` once with the line
naming the lost ranks (flows/launch.py stops the rank). It also bounds the wait for a peer whose
machine vanished without closing its connections, which no collective notices before
train.parallel_timeout_s.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

BEAT_S = 1.0
"""Seconds between two beats of a rank."""
SILENT_S = 5.0
"""Seconds without a beat after which a rank counts as lost (a live one beats within BEAT_S)."""


class StoreLost(RuntimeError):
    """The launch's store (hosted with node 0's launcher) no longer answers."""


def beat_key(rank: int) -> str:
    return f"rlpipe/beat/{rank}"


def where_key(rank: int) -> str:
    return f"rlpipe/where/{rank}"


def stopped(first: list[int], now: list[int], alive: set[int], rank: int) -> set[int]:
    """The ranks other than `rank` not yet seen alive: `alive` plus those whose counter moved
    from `first` to `now` are alive."""
    moved = {r for r, (a, b) in enumerate(zip(first, now, strict=True)) if b > a}
    return set(range(len(first))) - {rank} - alive - moved


def still(last: dict[int, tuple[int, float]], counts: dict[int, int], now: float,
          lost_after_s: float) -> tuple[dict[int, tuple[int, float]], list[int]]:
    """(each watched rank's (counter, when it last moved), the ranks whose counter has not moved
    for more than `lost_after_s`); `last` as it was at the previous beat."""
    moved = {r: (c, now) if r not in last or c != last[r][0] else last[r] for r, c in counts.items()}
    return moved, sorted(r for r, (_, since) in moved.items() if now - since > lost_after_s)


def lost_line(lost: list[int], where: dict[int, str], world_size: int, silent_s: float) -> str:
    """'lost rank 1 of 2 (node 1, host h, pid 12): no heartbeat for 5 s, its process or node died'."""
    ranks = ", ".join(f"rank {r}" + (f" ({where[r]})" if where.get(r) else "") for r in lost)
    return (f"lost {ranks} of {world_size}: no heartbeat for {silent_s:g} s, "
            f"{'its' if len(lost) == 1 else 'their'} process or node died")


@dataclass
class PeerWatch:
    """This rank's heartbeat thread and a store client to read every rank's counter."""

    rank: int
    world_size: int
    host: str
    port: int
    beat_s: float = BEAT_S
    lost_after_s: float = 30.0
    on_lost: Callable[[str], None] | None = None
    """Called once, from the heartbeat thread, with the line naming the lost ranks."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        store = _client(self.host, self.port)
        store.set(where_key(self.rank), f"node {os.environ.get('GROUP_RANK', '?')}, host {socket.gethostname()}, "
                                        f"pid {os.getpid()}")
        self._thread = threading.Thread(target=self._beat, args=(store,), name="rlpipe-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self, store) -> None:
        watched = [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]
        last: dict[int, tuple[int, float]] = {}
        while not self._stop.is_set():
            try:
                store.add(beat_key(self.rank), 1)
                last, lost = still(last, {r: store.add(beat_key(r), 0) for r in watched}, time.monotonic(),
                                   self.lost_after_s)
                where = {r: store.get(where_key(r)).decode() for r in lost if store.check([where_key(r)])}
            except Exception as error:  # noqa: BLE001 - node 0's store is gone
                if not self._stop.is_set():
                    self._lost(f"lost node 0: the launch's store at {self.host}:{self.port} (hosted by node 0's "
                               f"launcher) does not answer ({type(error).__name__})")
                return
            if lost:
                self._lost(lost_line(lost, where, self.world_size, self.lost_after_s))
                return
            self._stop.wait(self.beat_s)

    def _lost(self, line: str) -> None:
        if self.on_lost is not None and not self._stop.is_set():
            self.on_lost(line)

    def silent(self, silent_s: float = SILENT_S) -> tuple[list[int], dict[int, str]]:
        """(the other ranks with no beat within `silent_s`, where each of them ran); returns as
        soon as every other rank beat. Raises StoreLost where the store does not answer."""
        try:
            store = _client(self.host, self.port, timeout_s=silent_s)

            def counts() -> list[int]:
                return [store.add(beat_key(r), 0) for r in range(self.world_size)]

            first, alive = counts(), set()
            deadline = time.monotonic() + silent_s
            while (left := stopped(first, counts(), alive, self.rank)) and time.monotonic() < deadline:
                alive = set(range(self.world_size)) - {self.rank} - left
                time.sleep(min(0.2, self.beat_s))
            where = {r: store.get(where_key(r)).decode() for r in left if store.check([where_key(r)])}
        except StoreLost:
            raise
        except Exception as error:  # noqa: BLE001 - a lost store is the answer
            raise StoreLost(f"the launch's store at {self.host}:{self.port} (hosted by node 0's launcher) does not "
                            f"answer ({type(error).__name__}: {' '.join(str(error).split())[:200]})") from None
        return sorted(left), where

    def close(self) -> None:
        self._stop.set()


def _client(host: str, port: int, timeout_s: float = 30.0):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


_ACTIVE: list[PeerWatch] = []


def start_watch(rank: int, world_size: int, lost_after_s: float = 30.0,
                on_lost: Callable[[str], None] | None = None) -> PeerWatch:
    """Start this rank's heartbeat in torchrun's store (MASTER_ADDR:MASTER_PORT), watching as the
    module docstring says; `active()` returns it until closed."""
    watch = PeerWatch(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      lost_after_s=lost_after_s, on_lost=on_lost).start()
    _ACTIVE[:] = [watch]
    return watch


def active() -> PeerWatch | None:
    """The watch of this process's rank, where one runs."""
    return _ACTIVE[0] if _ACTIVE else None


def stop_watch() -> None:
    for watch in _ACTIVE:
        watch.close()
    _ACTIVE.clear()
