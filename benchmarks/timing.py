"""Wall-clock timing of device work for the GPU benchmarks."""

from __future__ import annotations

import time

import torch
from rlpipe.models.device import synchronize


def timed(fn, repeats: int, warmup: int = 2, device: torch.device | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones, the device's queue
    drained around each (CUDA unless `device` says otherwise)."""
    device = device or torch.device("cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times
