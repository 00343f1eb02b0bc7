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
        if "mixture" in state:
            raise ValueError("prompt state is of a mixture of environments, this run has one (task.envs changed "
                             "since the checkpoint)")
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


DRAW_BLOCK = 1024
"""Prompts whose environments one generator call draws (`mixture_draws`)."""


def mixture_draws(seed: int, weights: Sequence[float], start: int, k: int) -> list[int]:
    """The entries (indices into `weights`) of the prompts `start .. start+k-1` of a mixture:
    each drawn independently with probability weight / sum, by a generator seeded with the run
    seed and the block of `DRAW_BLOCK` prompts the position falls in. A pure function of its
    arguments, so a resumed run needs only the position to draw what it would have drawn."""
    if start < 0 or k < 0:
        raise ValueError(f"mixture_draws: start and k must be >= 0, got {start}, {k}")
    p = np.asarray(weights, dtype=float)
    if p.ndim != 1 or len(p) == 0 or not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError(f"mixture_draws: weights must be positive and finite, got {list(weights)}")
    p = p / p.sum()
    out: list[int] = []
    position = start
    while len(out) < k:
        block, offset = divmod(position, DRAW_BLOCK)
        drawn = np.random.default_rng([seed, 0x6D6978, block]).choice(len(p), size=DRAW_BLOCK, p=p)
        take = min(k - len(out), DRAW_BLOCK - offset)
        out.extend(int(i) for i in drawn[offset : offset + take])
        position += take
    return out


class MixturePromptSource:
    """Prompts of several environments: each prompt's environment is drawn by weight
    (`mixture_draws`), then its example comes from that environment's own `PromptSource`
    (shuffled per epoch, seeded by the run seed and the entry's index). `state_dict()` holds the
    draw position and every entry's position: a resumed run draws exactly the same prompts."""

    def __init__(self, sources: dict[str, PromptSource], weights: dict[str, float], seed: int = 0) -> None:
        if not sources or set(sources) != set(weights):
            raise ValueError("MixturePromptSource: give one weight per source (and at least one source)")
        self.names = list(sources)
        self.sources = sources
        self.weights = [float(weights[name]) for name in self.names]
        mixture_draws(seed, self.weights, 0, 0)  # checks the weights
        self.seed = seed
        self.drawn = 0

    def next_batch(self, k: int) -> list[Example]:
        """The next `k` prompts, in draw order."""
        if k < 1:
            raise ValueError(f"next_batch: need k >= 1, got {k}")
        picks = mixture_draws(self.seed, self.weights, self.drawn, k)
        self.drawn += k
        taken = {i: iter(self.sources[self.names[i]].next_batch(picks.count(i)))
                 for i in sorted(set(picks))}
        return [next(taken[i]) for i in picks]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: {"mixture": {seed, drawn, names, weights}, "sources": {name: state}}."""
        return {"mixture": {"seed": self.seed, "drawn": self.drawn, "names": self.names, "weights": self.weights},
                "sources": {name: source.state_dict() for name, source in self.sources.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; ValueError if it was saved for other entries or weights."""
        mixture = state.get("mixture")
        if mixture is None:
            raise ValueError("prompt state is of a single environment, this run is a mixture (task.envs changed "
                             "since the checkpoint)")
        if list(mixture["names"]) != self.names or [float(w) for w in mixture["weights"]] != self.weights:
            raise ValueError(f"prompt state is for the mixture {dict(zip(mixture['names'], mixture['weights'], strict=True))}, "
                             f"this run's is {dict(zip(self.names, self.weights, strict=True))}: task.envs changed since the "
                             "checkpoint")
        for name, source in self.sources.items():
            source.load_state_dict(state["sources"][name])
        self.seed, self.drawn = int(mixture["seed"]), int(mixture["drawn"])
