"""Per-environment metrics of a mixture's step (`[[task.envs]]`): `rollout/<env>/<name>`.

Over the completions a step sampled, per environment (the rollouts' `env`):
- `reward_mean`: mean reward (that environment's reward; reward errors count as 0, as scored),
- `accuracy`: share of completions whose `correct` reward component is 1 (an environment
  without that component: share with a positive reward),
- `zero_var_fraction`: share of its sampled groups whose completions all got the same reward,
- `samples`: completions sampled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from rlpipe.core import metric_names as m
from rlpipe.rollouts.records import Rollout, Score


def _correct(score: Score) -> float:
    components = score.components
    parts = dict(components) if isinstance(components, dict) else dict(components or [])
    if "correct" in parts:
        return float(parts["correct"] == 1)
    return float(score.reward > 0)


def env_metrics(rollouts: Iterable[Rollout], scores: Iterable[Score]) -> dict[str, float]:
    """The `rollout/<env>/*` metrics of sampled `rollouts` and their `scores` (by sample_id)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    correct: dict[str, list[float]] = defaultdict(list)
    groups: dict[str, dict[str, set[float]]] = defaultdict(lambda: defaultdict(set))
    by_sample = {score.sample_id: score for score in scores}
    for rollout in rollouts:
        score = by_sample.get(rollout.sample_id)
        if score is None:
            continue
        rewards[rollout.env].append(score.reward)
        correct[rollout.env].append(_correct(score))
        groups[rollout.env][rollout.group_id].add(score.reward)
    out: dict[str, float] = {}
    for name, values in rewards.items():
        flat = sum(len(seen) == 1 for seen in groups[name].values())
        out[m.env(name, "reward_mean")] = sum(values) / len(values)
        out[m.env(name, "accuracy")] = sum(correct[name]) / len(values)
        out[m.env(name, "zero_var_fraction")] = flat / len(groups[name])
        out[m.env(name, "samples")] = float(len(values))
    return out
