"""A mixture of environments (`[[task.envs]]`): one `Environment` over several named entries.

    env = MixtureEnv({"add": ArithmeticEnv(...), "cd": CountdownEnv(...)}, {"add": 3, "cd": 1})
    env.examples("train")        # every entry's examples, env = the entry's name
    env.reward(example, text)    # the reward of the entry the example came from

An example of entry NAME has `env = NAME` and `example_id = NAME/<the entry's own id>`, so ids
stay unique across entries (two environments may both number theirs `train/0/17`) and every table
row, group and query keyed by `(env, example_id)` or by `example_id` alone keeps entries apart.
`reset`, `step`, `reward` and `demonstration` hand the entry its own example back.

`examples(split)` interleaves the entries by weight (`mixture_draws` over the seed), so the first
`task.eval_examples` held-out examples, or an SFT phase's first conversations, are a weighted mix.
RL's prompts are drawn by envs/prompts.py `MixturePromptSource` (`prompt_source` builds the right
source for any env).
Multi-turn environments cannot be mixed (one sampling path per batch).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from rlpipe.envs.base import (
    Environment,
    Example,
    LazyExamples,
    Messages,
    RewardResult,
    Split,
    StepResult,
)
from rlpipe.envs.prompts import DRAW_BLOCK, MixturePromptSource, PromptSource, mixture_draws


def mixed_example(name: str, example: Example) -> Example:
    """`example` of entry `name` as the mixture gives it out (env = name, id prefixed)."""
    return dataclasses.replace(example, env=name, example_id=f"{name}/{example.example_id}")


class MixtureEnv:
    """Several environments as one (see the module docstring)."""

    name = "mixture"
    max_turns = 1

    def __init__(self, envs: dict[str, Environment], weights: dict[str, float]) -> None:
        if not envs or set(envs) != set(weights):
            raise ValueError("MixtureEnv: give one weight per environment (and at least one environment)")
        for entry, env in envs.items():
            if getattr(env, "max_turns", 1) > 1:
                raise ValueError(f"task.envs: entry {entry!r} is multi-turn ({env.name}); a mixture takes "
                                 "single-turn environments only")
        self.envs, self.weights = dict(envs), {name: float(weights[name]) for name in envs}

    def entry(self, example: Example) -> tuple[Environment, Example]:
        """The entry's environment and its own example for a mixture example."""
        env = self.envs.get(example.env)
        prefix = f"{example.env}/"
        if env is None or not example.example_id.startswith(prefix):
            raise ValueError(f"example {example.env}/{example.example_id} is not from this mixture "
                             f"(entries: {', '.join(self.envs)})")
        return env, dataclasses.replace(example, env=env.name, example_id=example.example_id[len(prefix):])

    def entry_examples(self, split: Split, seed: int = 0) -> dict[str, Sequence[Example]]:
        """Each entry's examples of `split`, as the mixture gives them out."""
        return {name: _Relabelled(name, env.examples(split, seed=seed)) for name, env in self.envs.items()}

    def examples(self, split: Split, seed: int = 0) -> Sequence[Example]:
        """Every entry's examples of `split` once, interleaved by weight (what SFT of a mixture
        and the held-out set read; RL's prompts come from `prompt_source`)."""
        parts = self.entry_examples(split, seed)
        return _interleaved(parts, [self.weights[name] for name in parts], seed)

    def reset(self, example: Example) -> Messages:
        """The entry's initial messages for its own example."""
        env, own = self.entry(example)
        return env.reset(own)

    def step(self, example: Example, messages: Messages, completion_text: str) -> StepResult:
        """The entry's answer to an assistant turn (single-turn entries: done)."""
        env, own = self.entry(example)
        return env.step(own, messages, completion_text)

    def reward(self, example: Example, transcript: str | Messages) -> RewardResult:
        """The entry's own reward of the completion."""
        env, own = self.entry(example)
        return env.reward(own, transcript)

    def demonstration(self, example: Example, rng: Any) -> str:
        """The entry's SFT demonstration (its teacher, else the example's target)."""
        env, own = self.entry(example)
        teacher = getattr(env, "demonstration", None)
        if callable(teacher):
            return teacher(own, rng)
        return str(own.meta["target_text"]) if "target_text" in own.meta else str(own.answer)


class _Relabelled(Sequence[Example]):
    """An entry's examples as the mixture gives them out (`mixed_example`), generated on access."""

    def __init__(self, name: str, examples: Sequence[Example]) -> None:
        self._name, self._examples = name, examples

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return mixed_example(self._name, self._examples[i])


def _interleaved(parts: dict[str, Sequence[Example]], weights: list[float], seed: int) -> Sequence[Example]:
    """Every example of `parts` once, in an order whose every prefix mixes the entries by weight
    (an entry that runs out is skipped)."""
    names = list(parts)
    taken = dict.fromkeys(names, 0)
    order: list[tuple[str, int]] = []
    total, position = sum(len(part) for part in parts.values()), 0
    while len(order) < total:
        for pick in mixture_draws(seed, weights, position, DRAW_BLOCK):
            name = names[pick]
            if taken[name] < len(parts[name]):
                order.append((name, taken[name]))
                taken[name] += 1
        position += DRAW_BLOCK
        if position > 8 * total + DRAW_BLOCK:  # the heavy entries ran out: the rest in entry order
            order += [(name, i) for name in names for i in range(taken[name], len(parts[name]))]
            break
    return LazyExamples(len(order), lambda i: parts[order[i][0]][order[i][1]])


def prompt_source(env: Environment, seed: int, pool: int = 0) -> PromptSource | MixturePromptSource:
    """The training prompt stream of `env` (unwrapped through reward wrappers): a mixture's
    weighted draw over its entries, else one shuffled `PromptSource` of its train split. With
    `pool` > 0 (`rl.prompt_pool`) each environment's stream holds its first `pool` train examples
    only, so that prompts come back."""
    mixture = mixture_of(env)
    if mixture is None:
        train = env.examples("train", seed=seed)
        return PromptSource(train[:pool] if pool else train, seed=seed)
    parts = mixture.entry_examples("train", seed)
    sources = {name: PromptSource(examples[:pool] if pool else examples, seed=seed * 1000 + index)
               for index, (name, examples) in enumerate(parts.items())}
    return MixturePromptSource(sources, mixture.weights, seed=seed)


def train_pool(env: Environment, seed: int, pool: int = 0) -> Iterable[Example]:
    """Every training prompt `prompt_source` can deal (each environment's first `pool` with
    `pool` > 0), lazily, environment after environment: where a resumed run reads its prompts'
    curriculum classes from."""
    mixture = mixture_of(env)
    parts = [env.examples("train", seed=seed)] if mixture is None else list(mixture.entry_examples("train", seed).values())
    return itertools.chain.from_iterable(part[:pool] if pool else part for part in parts)


def mixture_of(env: Any) -> MixtureEnv | None:
    """The `MixtureEnv` inside `env`'s wrappers (reward timeout, model rewards), or None."""
    seen = 0
    while env is not None and seen < 8:
        if isinstance(env, MixtureEnv):
            return env
        env = vars(env).get("inner", vars(env).get("env")) if hasattr(env, "__dict__") else None
        seen += 1
    return None
