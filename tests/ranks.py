"""Run a function on several ranks at once, each a fork of this test process, with a time limit.

The data-parallel tests compare what 2 ranks (gloo on the CPU) compute with one process. Spawned
ranks (torch.multiprocessing.spawn) each start a fresh interpreter that imports the test module
again, torch and rlpipe with it: 5-10 s per rank on 2 busy cores, for steps that take a fraction
of a second. Forked ranks start with everything imported. That is safe here: this process holds no
process group (each rank makes its own, through a file store), runs torch single-threaded
(tests/conftest.py), and the ranks only build, train and save; they leave through
multiprocessing's `os._exit`, running none of pytest's exit handlers. What the ranks compute does
not depend on how they started (the launcher a run uses is tests/unit/test_launch.py's, and
test_distributed_run.py's end to end).

Nothing here waits forever: ranks still running after `timeout_s` are killed and the test fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2, timeout_s: float = 600) -> None:
    """fn(rank, *args) in `nprocs` forked processes; returns once all exited, raises (naming the
    rank and its traceback) where one raised or died, or where they outlive `timeout_s`."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"{getattr(fn, '__name__', fn)}: ranks still running after {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=30)
