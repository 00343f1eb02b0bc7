"""PromptSource: an endless, resumable, deterministically shuffled stream of examples.

Epoch e visits every example once in the order `permutation(seed, e)`; `next_batch(k)` continues
where the last call stopped and crosses epoch boundaries. `state_dict()` (epoch, offset, seed, size)
is plain JSON, saved in a checkpoint's data_state.json, so a resumed run draws exactly the prompts
it would have drawn without the stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rlpipe.envs.base import Example


class PromptSource:
    """Shuffled batches of `examples` (a Sequence; generated examples are fine)."""

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(examples) == 0:
            raise ValueError("PromptSource: the example set is empty")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"PromptSource: batch_size must be >= 1, got {batch_size}")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order: np.ndarray | None = None  # permutation of the current epoch (cached)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = len(self.examples)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
        return self._order

    def next_batch(self, k: int | None = None) -> list[Example]:
        """The next `k` examples (default: batch_size), crossing into the next epoch as needed."""
        k = self.batch_size if k is None else k
        if k is None or k < 1:
            raise ValueError(f"next_batch: need k >= 1 (or a batch_size), got {k}")
        out: list[Example] = []
        n = len(self.examples)
        while len(out) < k:
            order = self._epoch_order()
            take = min(k - len(out), n - self.offset)
            out.extend(self.examples[int(i)] for i in order[self.offset : self.offset + take])
            self.offset += take
            if self.offset == n:
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: {"seed", "epoch", "offset", "n_examples", "shuffle"}."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "offset": self.offset,
            "n_examples": len(self.examples),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; ValueError if it was saved for a different example set."""
        if int(state["n_examples"]) != len(self.examples):
            raise ValueError(
                f"PromptSource state is for {state['n_examples']} examples, this source has "
                f"{len(self.examples)}: the dataset changed since the checkpoint"
            )
        offset = int(state["offset"])
        if not 0 <= offset < len(self.examples):
            raise ValueError(f"PromptSource state: offset {offset} out of range")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = offset
        self.shuffle = bool(state.get("shuffle", True))
        self._order = None
