"""What `rlpipe serve` generates with: the loaded checkpoint, the slot that swaps it, and the
request batcher.

`ModelSlot` holds the served model; a reload swaps it under the lock generation holds, so a
generate call sees the old or the new weights, never a mix. `Batcher` merges requests that
arrive within `batch_window_ms` and share sampling parameters into one `TorchEngine.generate`
call; a request with an explicit `seed` is never merged (its draws would depend on the batch).
The HTTP layer is engines/serve_app.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rlpipe.engines.base import Completion, SamplingParams
from rlpipe.engines.torch_engine import TokenCallback, TorchEngine
from rlpipe.models.device import resolve_device

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

    @property
    def max_model_len(self) -> int | None:
        """The model's context length (max_position_embeddings), None when its config has none."""
        value = getattr(self.engine.model.config, "max_position_embeddings", None)
        return int(value) if value is not None else None


def load_served_model(path: str | Path, device: str = "auto") -> ServedModel:
    """Load what `path` names (engines/serve_sources.py: a checkpoint, verified by its sha256, a
    run folder's newest checkpoint, a Hugging Face model folder or a hub id).

    Raises ValueError naming the path for a missing, incomplete or corrupt checkpoint or model.
    """
    from rlpipe.engines.serve_sources import served_source
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.training.checkpoint_io import load_checkpoint

    source = served_source(path)
    path = source.path
    if source.is_checkpoint:
        checkpoint = load_checkpoint(path, restore_rng=False)
        if "policy_version" not in checkpoint.metadata:
            raise ValueError(f"checkpoint {str(path)!r}: metadata.json has no policy_version")
        model, tokenizer = checkpoint.model, checkpoint.tokenizer
        version = int(checkpoint.metadata["policy_version"])
    else:  # a plain model: policy version 0
        model, tokenizer, version = load_model(path), load_tokenizer(path), 0
    model = model.to(resolve_device(device, "--device")).eval()
    # bf16 sampling on CUDA, as the in-process engine of a bf16-autocast run does
    dtype = torch.bfloat16 if model.device.type == "cuda" else None
    return ServedModel(
        path=path,
        tokenizer=tokenizer,
        engine=TorchEngine(model, dtype=dtype, policy_version=version),
        policy_version=version,
    )


class ModelSlot:
    """The model in service. `generate` and `swap` take the same lock, so a weight reload never
    overlaps a generate call; requests are cut into short calls, so a reload waits for one call,
    not for a whole long request."""

    def __init__(self, served: ServedModel) -> None:
        self._served = served
        self._lock = threading.Lock()

    @property
    def current(self) -> ServedModel:
        return self._served

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, pinned: ServedModel | None = None,
        on_token: TokenCallback | None = None, cancelled: Callable[[], bool] | None = None,
    ) -> tuple[list[list[Completion]], ServedModel]:
        """Completions and the model that made them (blocking; run it off the event loop).
        pinned: the model an earlier part of the same request used (a request sees one model,
        even when a reload lands between its parts); default: the current one.
        on_token: TorchEngine.generate's streaming callback. cancelled: asked between decode
        steps; True stops the call (engines.decode_loop.GenerationCancelled)."""
        with self._lock:
            served = pinned or self._served
            return served.engine.generate(prompts, params, on_token=on_token, cancelled=cancelled), served

    def top_logprobs(self, served: ServedModel, sequences: list[tuple[list[int], list[int]]], k: int,
                     temperature: float) -> list[list[list[tuple[int, float]]]]:
        """For each (prompt, completion), the `k` most likely tokens and their log-probs at each
        completion position (blocking; run it off the event loop), under the lock."""
        with self._lock:
            return [top_logprobs(served.engine.model, prompt, tokens, k, temperature)
                    for prompt, tokens in sequences]

    def prompt_logprobs(self, served: ServedModel, prompts: list[list[int]], k: int
                        ) -> list[list[tuple[float, int, list[tuple[int, float]]]]]:
        """For each prompt, `prompt_logprobs` of each of its tokens after the first (blocking; run
        it off the event loop), under the lock."""
        with self._lock:
            return [prompt_logprobs(served.engine.model, prompt, k) for prompt in prompts]

    def swap(self, served: ServedModel) -> ServedModel:
        """Put `served` in service; returns the model taken out. It is not closed: requests
        already generating with it finish with it, and it is freed with their last reference."""
        with self._lock:
            old, self._served = self._served, served
        return old


_TOP_CHUNK = 256  # completion positions whose full-vocabulary logits are held at once


def top_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], k: int,
                 temperature: float) -> list[list[tuple[int, float]]]:
    """The `k` most likely next tokens, with their log-probs under softmax(logits / temperature)
    (engines/base.py's convention, untruncated), before each of `tokens` after `prompt`: one
    forward pass of prompt + completion, the vocabulary projected a chunk of positions at a time."""
    if not tokens or k < 1:
        return [[] for _ in tokens]
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
        head = model.get_output_embeddings()
        out: list[list[tuple[int, float]]] = []
        for start in range(0, hidden.shape[0], _TOP_CHUNK):
            logits = head(hidden[start : start + _TOP_CHUNK]).float() / temperature
            values, indices = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
            out += [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)]
    return out


def prompt_logprobs(model: torch.nn.Module, prompt: list[int], k: int
                    ) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """vLLM's `prompt_logprobs`: for each token of `prompt` after the first, its log-prob given
    the tokens before it under softmax(logits) (temperature 1, the model's own distribution), its
    rank (1 = the most likely) and the `k` most likely tokens there; one forward pass, the
    vocabulary projected a chunk of positions at a time."""
    if len(prompt) < 2:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    nexts = torch.tensor(prompt[1:], device=device)
    out: list[tuple[float, int, list[tuple[int, float]]]] = []
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids[:, :-1]).last_hidden_state[0]
        head = model.get_output_embeddings()
        for start in range(0, hidden.shape[0], _TOP_CHUNK):
            logprobs = torch.log_softmax(head(hidden[start : start + _TOP_CHUNK]).float(), dim=-1)
            picked = logprobs.gather(-1, nexts[start : start + _TOP_CHUNK, None])
            ranks = (logprobs > picked).sum(-1) + 1
            tops = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k > 0 else None
            for row in range(logprobs.shape[0]):
                top = list(zip(tops.indices[row].tolist(), tops.values[row].tolist(), strict=True)) if tops else []
                out.append((float(picked[row, 0]), int(ranks[row]), top))
    return out


# ----------------------------------------------------------------------------- batching


@dataclass(eq=False)
class _Job:
    """One request: its prompts cut into parts of at most `chunk_sequences` sequences."""

    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future
    parts: list[list[list[int]]] = field(default_factory=list)
    results: list[list[Completion]] = field(default_factory=list)
    served: ServedModel | None = None  # pinned by the first part
    done_parts: int = 0
    on_token: TokenCallback | None = None  # (prompt index in the job, sample, token, logprob)

    def part_offset(self, index: int) -> int:
        """The job's index of part `index`'s first prompt."""
        return sum(len(part) for part in self.parts[:index])


@dataclass
class _Unit:
    """One part of one job: what a single engine call (possibly merged) generates."""

    job: _Job
    index: int

    @property
    def prompts(self) -> list[list[int]]:
        return self.job.parts[self.index]

    @property
    def params(self) -> SamplingParams:
        params = self.job.params
        if params.seed is None or self.index == 0:
            return params  # a one-part seeded request equals the in-process engine's answer
        return replace(params, seed=(params.seed + self.index) % 2**64)


@dataclass
class BatchStats:
    """Counters of the batching worker (read by tests, benchmarks and /health)."""

    requests: int = 0
    engine_calls: int = 0
    prompts: int = 0
    dropped: int = 0  # requests whose client went away or whose deadline passed mid-way


def split_prompts(prompts: list[list[int]], n: int, chunk_sequences: int) -> list[list[list[int]]]:
    """Prompts cut into consecutive parts of at most `chunk_sequences` sequences (prompts x n);
    a part holds at least one prompt."""
    per_part = max(1, chunk_sequences // max(n, 1))
    return [prompts[i : i + per_part] for i in range(0, len(prompts), per_part)]


def group_jobs(jobs: list) -> list[list]:
    """Group units (or jobs) that can share one engine call: equal sampling params, the same
    pinned model, and no explicit seed (a seeded one stays alone so its draws match a solo run).
    Order of first arrival kept."""
    groups: dict[Any, list] = {}
    for index, job in enumerate(jobs):
        pinned = id(job.job.served) if isinstance(job, _Unit) and job.job.served is not None else None
        key = (job.params, pinned) if job.params.seed is None else ("seeded", index)
        groups.setdefault(key, []).append(job)
    return list(groups.values())


def cap_sequences(group: list[_Unit], limit: int) -> list[list[_Unit]]:
    """A group cut into engine calls of at most `limit` sequences (a unit is never cut)."""
    calls: list[list[_Unit]] = [[]]
    size = 0
    for unit in group:
        need = len(unit.prompts) * unit.params.n
        if calls[-1] and size + need > limit:
            calls.append([])
            size = 0
        calls[-1].append(unit)
        size += need
    return calls


def _nobody_waits(units: list[_Unit]) -> Callable[[], bool]:
    """The engine call's `cancelled`: True once every request it generates for has been answered
    or dropped (client gone, deadline passed), so a long call stops between two decode steps
    instead of finishing for nobody. Read from the engine's thread: a future's done() only reads
    its state."""
    jobs = [unit.job for unit in units]
    return lambda: all(job.future.done() for job in jobs)


def _stream_to(units: list[_Unit]) -> TokenCallback | None:
    """The engine call's token callback, routing prompt i of the call to its job's own callback
    (None when no job of the call streams)."""
    if all(unit.job.on_token is None for unit in units):
        return None
    owners: list[tuple[_Job, int]] = []
    for unit in units:
        offset = unit.job.part_offset(unit.index)
        owners += [(unit.job, offset + k) for k in range(len(unit.prompts))]

    def on_token(i: int, j: int, token: int, logprob: float) -> None:
        job, index = owners[i]
        if job.on_token is not None and not job.future.done():
            job.on_token(index, j, token, logprob)

    return on_token


class Batcher:
    """A queue and one worker task: merges requests that arrive within `window_s`, and runs long
    requests part by part, one part of each waiting request per round, so that a small request
    never waits for a long one to finish (and a reload waits for one engine call at most)."""

    def __init__(self, slot: ModelSlot, window_s: float, max_prompts: int, chunk_sequences: int = 64) -> None:
        if window_s < 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window_s}")
        if max_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_prompts}")
        if chunk_sequences < 1:
            raise ValueError(f"chunk_sequences must be >= 1, got {chunk_sequences}")
        self.slot = slot
        self.window_s = window_s
        self.max_prompts = max_prompts
        self.chunk_sequences = chunk_sequences
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(
        self, prompts: list[list[int]], params: SamplingParams, on_token: TokenCallback | None = None
    ) -> tuple[list[list[Completion]], ServedModel]:
        """Queue a request and wait for its completions (the worker starts on first use).
        Cancelling the wait (client gone, deadline) drops the request's remaining parts.
        on_token(i, j, token, logprob): each token of completion j of prompt i as it is sampled,
        called from the engine's thread (streaming)."""
        loop = asyncio.get_running_loop()
        # (Re)start the worker in this loop: a test client may run each request in a new loop.
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._queue = loop, asyncio.Queue()
            self._task = loop.create_task(self._run())
        assert self._queue is not None
        job = _Job(prompts, params, loop.create_future(),
                   parts=split_prompts(prompts, params.n, self.chunk_sequences), on_token=on_token)
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

    async def _collect(self, active: list[_Job]) -> list[_Job]:
        """New jobs: wait for one (and the batch window) when idle, else take what is queued."""
        assert self._queue is not None
        jobs = []
        if not active:
            jobs.append(await self._queue.get())
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
        while not self._queue.empty():
            jobs.append(self._queue.get_nowait())
        return jobs

    async def _run(self) -> None:
        active: list[_Job] = []
        while True:
            active = self._prune(active)
            active = self._prune(active + await self._collect(active))
            units = [_Unit(job, job.done_parts) for job in active]
            for group in group_jobs(units):
                for call in cap_sequences(group, self.max_prompts):
                    await self._run_group(call)

    def _prune(self, jobs: list[_Job]) -> list[_Job]:
        """Jobs still waiting for parts; a cancelled one (client gone, deadline) is counted."""
        self.stats.dropped += sum(job.future.cancelled() for job in jobs)
        return [job for job in jobs if not job.future.done()]

    async def _run_group(self, group: list[_Unit]) -> None:
        units = [unit for unit in group if not unit.job.future.done()]
        if not units:
            return
        prompts = [p for unit in units for p in unit.prompts]
        self.stats.engine_calls += 1
        self.stats.prompts += len(prompts)
        try:
            completions, served = await asyncio.to_thread(
                self.slot.generate, prompts, units[0].params, units[0].job.served, _stream_to(units),
                _nobody_waits(units),
            )
        except Exception as exc:  # noqa: BLE001 - handed to every waiting request
            for unit in units:
                if not unit.job.future.done():
                    unit.job.future.set_exception(exc)
            return
        start = 0
        for unit in units:
            job = unit.job
            part = completions[start : start + len(unit.prompts)]
            start += len(unit.prompts)
            job.served = served
            job.results += part
            job.done_parts += 1
            if job.done_parts == len(job.parts) and not job.future.done():
                job.future.set_result((job.results, served))
