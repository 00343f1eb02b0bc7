"""The in-process engine's sampler in a child process, for async RL without the GIL.

With `rl.off_policy.max_steps >= 1` and `engine.producer = "process"`, the producer thread of
rollouts/source.py hands each `generate` to a child process and waits on a pipe, so the trainer's
Python code and the decode loop no longer take turns on one interpreter lock. The weights the
child samples from live in shared memory (a copy of the trainer's model whose tensors
`share_memory_()` moved there, sent to the child once through torch.multiprocessing): `sync`
copies the trainer's weights into them in place, between two `generate` calls (never during
one), and tells the child the new policy version. Sampling is the torch engine's
(engines/torch_engine.py): same seed, prompts and weights give the same completions as in process.
The child is started by spawn (the parent runs threads), which imports the main module again: a
script that starts a run keeps its top-level code under `if __name__ == "__main__":`.

    engine = ProcessEngine(model, threads=1)       # model: the nn.Module the optimizer updates
    engine.generate(prompts, params)               # sampled in the child (any thread here)
    engine.sync(None, version)                     # after an optimizer step, in the trainer
    engine.close()                                 # stops the child
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
import torch.multiprocessing as mp
from rlpipe.engines.base import Completion, SamplingParams
from torch import nn


class ProcessEngine:
    """TorchEngine over a shared-memory copy of `model`, run by a child process."""

    shares_weights = False
    syncs_from_checkpoint = False

    def __init__(self, model: nn.Module, policy_version: int = 0, dtype: torch.dtype | None = None,
                 threads: int = 0, start_timeout_s: float = 300.0) -> None:
        self._trainer = model
        shared = copy.deepcopy(model).requires_grad_(False)
        for tensor in [*shared.parameters(), *shared.buffers()]:
            tensor.share_memory_()
        self._shared = shared
        self._version = policy_version
        self._lock = threading.Lock()  # one request at a time; a sync waits for the generate in flight
        context = mp.get_context("spawn")  # the parent holds threads (Prefect, the writer): no fork
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(shared, child, policy_version, dtype, threads),
                                        name="rlpipe-sampler", daemon=True)
        self._process.start()
        child.close()
        self._start_timeout_s, self._started = start_timeout_s, False  # it starts while the run sets up
        self.name = "process"

    def _ready(self) -> None:
        """Wait for the child's ready message (or why it could not start), once."""
        if self._started:
            return
        if not self._conn.poll(self._start_timeout_s):
            self.close()
            raise RuntimeError(f"the sampler process did not start within {self._start_timeout_s:.0f} s")
        self._answer()
        self._started = True

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (in order), `params.n` completions (in order), sampled in the child."""
        with self._lock:
            self._ready()
            self._conn.send(("generate", (prompts, params)))
            return self._answer()

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """Copy the trainer's current weights (or a checkpoint's, given a path) into the shared
        ones; the child samples from them from its next `generate` on."""
        with self._lock:
            self._ready()
            if checkpoint_path is not None:
                from rlpipe.engines.torch_engine import load_weights_into

                load_weights_into(self._shared, checkpoint_path)
            else:
                with torch.no_grad():
                    for mine, theirs in zip(self._shared.parameters(), self._trainer.parameters(), strict=True):
                        mine.copy_(theirs)
            self._conn.send(("version", policy_version))
            self._answer()
            self._version = policy_version

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        if self._process.is_alive():
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def _answer(self) -> Any:
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the sampler process exited (exit code {self._process.exitcode}); a script that "
                               "starts a run must keep its top-level code under `if __name__ == '__main__':` "
                               "(the child, started by spawn, imports the main module again)") from None
        if kind == "error":
            raise RuntimeError(f"the sampler process failed: {payload}")
        return payload


def _serve(model: nn.Module, conn, policy_version: int, dtype: torch.dtype | None, threads: int) -> None:
    """The child: answer generate / version / close requests until closed or the parent is gone."""
    if threads:
        torch.set_num_threads(threads)
    try:
        from rlpipe.engines.torch_engine import TorchEngine

        engine = TorchEngine(model, dtype=dtype, policy_version=policy_version)
    except Exception as error:  # noqa: BLE001 - told to the parent, which raises it
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if kind == "close":
            return
        try:
            if kind == "generate":
                conn.send(("ok", engine.generate(*payload)))
            else:  # "version": the shared weights were updated in place
                engine.sync(None, payload)
                conn.send(("ok", None))
        except Exception as error:  # noqa: BLE001 - told to the parent, which raises it
            conn.send(("error", f"{type(error).__name__}: {error}"))
