"""An in-process engine over a private copy of the trainer's weights, for async RL.

With `rl.off_policy.max_steps >= 1` the trainer updates its model while rollouts of the next
steps are generated in a background thread. Sampling from the trainer's own tensors would mix
policy versions inside one completion, so this engine samples from a snapshot: `sync` copies
the trainer's weights into it (between two `generate` calls, never during one), and records the
policy version those weights are.

    engine = SnapshotEngine(model, policy_version=0)   # model: the nn.Module the optimizer updates
    engine.generate(prompts, params)                   # from the snapshot (any thread)
    engine.sync(None, version)                         # after an optimizer step, in the trainer

With `partial=True` (rl.off_policy.partial_rollouts) a sync does not wait for the `generate` in flight: it
lands between two of its decode steps (the sampling thread pauses there while a sync is waiting),
and the unfinished sequences go on from the new weights, each token recording the version that
sampled it (`Completion.versions`; engines/decode_loop.py recomputes their KV cache).
"""

from __future__ import annotations

import copy
import threading

import torch
from rlpipe.engines.base import Completion, SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from torch import nn


class SnapshotEngine:
    """TorchEngine over a deep copy of `model`, refreshed from it at each `sync`."""

    shares_weights = False
    syncs_from_checkpoint = False

    def __init__(self, model: nn.Module, policy_version: int = 0, dtype: torch.dtype | None = None,
                 partial: bool = False) -> None:
        self._trainer = model
        snapshot = copy.deepcopy(model)
        snapshot.requires_grad_(False)
        self._engine = TorchEngine(snapshot, dtype=dtype, policy_version=policy_version)
        # a sync waits for the generate in flight (partial: for its current decode step), and back
        self._lock = threading.Condition(threading.Lock())
        self._syncs_waiting = 0
        self._count = threading.Lock()
        self.partial = partial
        self.name = "snapshot"

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        with self._lock:
            return self._engine.generate(prompts, params, pause=self._pause if self.partial else None)

    def _pause(self) -> None:
        """Between two decode steps (the lock held): let a waiting sync in."""
        if self._syncs_waiting:
            self._lock.wait_for(lambda: self._syncs_waiting == 0)

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """Copy the trainer's current weights (or a checkpoint's, given a path) into the snapshot."""
        with self._count:
            self._syncs_waiting += 1  # a partial generate pauses at its next decode step
        with self._lock:
            with self._count:
                self._syncs_waiting -= 1
            self._lock.notify_all()  # the paused generate goes on once this sync releases the lock
            if checkpoint_path is None:
                with torch.no_grad():
                    for mine, theirs in zip(self._engine.model.parameters(), self._trainer.parameters(),
                                            strict=True):
                        mine.copy_(theirs)
            self._engine.sync(checkpoint_path, policy_version)

    def close(self) -> None:
        self._engine.close()
