"""What `rlpipe serve` serves: the loaded checkpoint, the slot that swaps it, and the batcher.

`ModelSlot` holds the served model; a reload swaps it under the lock generation holds, so a
generate call sees the old or the new weights, never a mix. `Batcher` merges requests that
arrive within `batch_window_ms` and share sampling parameters into one `TorchEngine.generate`
call; a request with an explicit `seed` is never merged (its draws would depend on the batch).
The HTTP layer is engines/server.py.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.base import Completion, SamplingParams
from engines.torch_engine import TorchEngine
from models.device import resolve_device

# ----------------------------------------------------------------------------- model state


@dataclass
class ServedModel:
    """One loaded checkpoint: the model, its tokenizer and the engine sampling from it."""

    path: Path
    tokenizer: Any
    engine: TorchEngine
    policy_version: int

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model.config.vocab_size)


def load_served_model(path: str | Path, device: str = "auto") -> ServedModel:
    """Load and verify a checkpoint written by `training.checkpoint.save_checkpoint`.

    Raises ValueError naming the path for a missing, incomplete or corrupt checkpoint.
    """
    from training.checkpoint import load_checkpoint

    path = Path(path)
    checkpoint = load_checkpoint(path, restore_rng=False)
    if "policy_version" not in checkpoint.metadata:
        raise ValueError(f"checkpoint {str(path)!r}: metadata.json has no policy_version")
    model = checkpoint.model.to(resolve_device(device, "--device")).eval()
    version = int(checkpoint.metadata["policy_version"])
    # bf16 sampling on CUDA, as the in-process engine of a bf16-autocast run does
    dtype = torch.bfloat16 if model.device.type == "cuda" else None
    return ServedModel(
        path=path,
        tokenizer=checkpoint.tokenizer,
        engine=TorchEngine(model, dtype=dtype, policy_version=version),
        policy_version=version,
    )


class ModelSlot:
    """The model in service. `generate` and `swap` take the same lock, so a weight reload never
    overlaps a generate call."""

    def __init__(self, served: ServedModel) -> None:
        self._served = served
        self._lock = threading.Lock()

    @property
    def current(self) -> ServedModel:
        return self._served

    def generate(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[Completion]], ServedModel]:
        """Completions and the model that made them (blocking; run it off the event loop)."""
        with self._lock:
            served = self._served
            return served.engine.generate(prompts, params), served

    def swap(self, served: ServedModel) -> ServedModel:
        """Put `served` in service; returns the model taken out (already closed)."""
        with self._lock:
            old, self._served = self._served, served
        old.engine.close()
        return old


# ----------------------------------------------------------------------------- batching


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future


@dataclass
class BatchStats:
    """Counters of the batching worker (read by tests and benchmarks)."""

    requests: int = 0
    engine_calls: int = 0
    prompts: int = 0


def group_jobs(jobs: list[_Job]) -> list[list[_Job]]:
    """Group jobs that can share one engine call: equal sampling params and no explicit seed
    (a seeded job stays alone so its draws match a solo run). Order of first arrival kept."""
    groups: dict[Any, list[_Job]] = {}
    for index, job in enumerate(jobs):
        key = job.params if job.params.seed is None else ("seeded", index)
        groups.setdefault(key, []).append(job)
    return list(groups.values())


class Batcher:
    """A queue and one worker task merging requests that arrive within `window_s`."""

    def __init__(self, slot: ModelSlot, window_s: float, max_prompts: int) -> None:
        if window_s < 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window_s}")
        if max_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_prompts}")
        self.slot = slot
        self.window_s = window_s
        self.max_prompts = max_prompts
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[Completion]], ServedModel]:
        """Queue a request and wait for its completions (the worker starts on first use)."""
        loop = asyncio.get_running_loop()
        # (Re)start the worker in this loop: a test client may run each request in a new loop.
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._queue = loop, asyncio.Queue()
            self._task = loop.create_task(self._run())
        assert self._queue is not None
        job = _Job(prompts, params, loop.create_future())
        self.stats.requests += 1
        await self._queue.put(job)
        return await job.future

    async def stop(self) -> None:
        if self._task is not None and self._loop is asyncio.get_running_loop():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None

    async def _collect(self) -> list[_Job]:
        assert self._queue is not None
        jobs = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while sum(len(j.prompts) * j.params.n for j in jobs) < self.max_prompts:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return jobs

    async def _run(self) -> None:
        while True:
            jobs = await self._collect()
            for group in group_jobs(jobs):
                await self._run_group(group)

    async def _run_group(self, group: list[_Job]) -> None:
        live = [job for job in group if not job.future.done()]  # a cancelled client is skipped
        if not live:
            return
        prompts = [p for job in live for p in job.prompts]
        self.stats.engine_calls += 1
        self.stats.prompts += len(prompts)
        try:
            completions, served = await asyncio.to_thread(
                self.slot.generate, prompts, live[0].params
            )
        except Exception as exc:  # noqa: BLE001 - handed to every waiting request
            for job in live:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        start = 0
        for job in live:
            part = completions[start : start + len(job.prompts)]
            start += len(job.prompts)
            if not job.future.done():
                job.future.set_result((part, served))
