"""Run a function on several ranks at once, each forked from a fork server, with a time limit.

The data-parallel tests compare what 2 ranks (gloo on the CPU) compute with one process. Spawned
ranks (torch.multiprocessing.spawn) each start a fresh interpreter that imports the test module
again, torch and rlpipe with it: 5-10 s per rank on 2 busy cores, for steps that take a fraction
of a second. Ranks forked from the test process itself started with everything imported, but
that process runs threads (the warm CLI's reader, Prefect's and Dask's clients of earlier tests),
and a fork taken while one of them held a lock crashed a rank in its garbage collector. So the
ranks fork from multiprocessing's fork server: one clean, single-threaded process per test worker
that imported torch and transformers once (FORKSERVER_PRELOAD). The ranks only build, train and
save, and leave through multiprocessing's `os._exit`. What they compute does not depend on how
they started (the launcher a run uses is tests/unit/test_launch.py's, and test_distributed_run.py's
end to end).

Nothing here waits forever: ranks still running after `timeout_s` are killed and the test fails.
"""

from __future__ import annotations

import multiprocessing.forkserver
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

FORKSERVER_PRELOAD = ["torch", "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3"]
multiprocessing.forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2, timeout_s: float = 600) -> None:
    """fn(rank, *args) in `nprocs` processes forked from the fork server (fn and args are pickled:
    a module's function and plain values); returns once all exited, raises (naming the
    rank and its traceback) where one raised or died, or where they outlive `timeout_s`."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
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
