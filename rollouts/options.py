"""The options of the rollout components, built from the `[rl]` section in one place.

Each component reads only its own frozen options: the group buffer (`BufferOptions`, with its
batch maker's `BatchMakerOptions`), the
advantage estimator (`AdvantageOptions`), the completions left out before grouping
(`DropOptions`); the rollout source holds them together with the few fields it reads itself.
The defaults and the meaning of every field are the `[rl]` section's.

    options = rollout_options(config.rl)
    buffer = GroupBuffer(options.buffer)
    source = RolloutSource(options, prompts, buffer, stages, start_step=0, published_version=0)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.rollouts.advantages import AdvantageOptions
from rlpipe.rollouts.batch_makers import BatchMakerOptions
from rlpipe.rollouts.curriculum import CurriculumOptions
from rlpipe.rollouts.fates import DropOptions
from rlpipe.rollouts.group_buffer import BufferOptions
from rlpipe.training.config import RLConfig


@dataclass(frozen=True)
class RolloutOptions:
    """What the rollout source reads: the run's length and pace, and its components' options."""

    steps: int
    ppo_epochs: int
    max_off_policy_steps: int
    buffer: BufferOptions
    drops: DropOptions
    advantages: AdvantageOptions
    partial_rollouts: bool = False
    """A sync does not wait for the sampling round in flight (the engine interrupts it)."""


def rollout_options(rl: RLConfig, *, seed: int = 0) -> RolloutOptions:
    """The rollout components' options from the `[rl]` config section; `seed` (the run's) seeds
    the batch maker."""
    maker = BatchMakerOptions(retention=rl.buffer.retention, max_age=rl.buffer.max_age, sampling=rl.buffer.sampling,
                              reservoir_size=rl.buffer.reservoir_size, seed=seed,
                              staleness_limit=max(rl.max_staleness, rl.max_off_policy_steps), spec=rl.batch_maker)
    return RolloutOptions(
        steps=rl.steps, ppo_epochs=rl.ppo_epochs, max_off_policy_steps=rl.max_off_policy_steps,
        buffer=BufferOptions(prompts_per_step=rl.prompts_per_step, oversample_factor=rl.oversample_factor,
                             max_attempts=rl.max_attempts, partial_batches=rl.partial_batches,
                             max_staleness=rl.max_staleness, max_off_policy_steps=rl.max_off_policy_steps,
                             drop_zero_variance=rl.drop_zero_variance, maker=maker),
        drops=DropOptions(drop_truncated=rl.drop_truncated, max_new_tokens=rl.sampling.max_new_tokens,
                          sample_filter=rl.sample_filter),
        advantages=AdvantageOptions(estimator=rl.estimator, normalize_std=rl.normalize_std,
                                    positive_only=rl.positive_only),
        partial_rollouts=rl.partial_rollouts,
    )


def curriculum_options(rl: RLConfig, seed: int) -> CurriculumOptions:
    """The prompt curriculum's options (rl.curriculum, rl.curriculum_*) with the run's seed."""
    return CurriculumOptions(kind=rl.curriculum, window=rl.curriculum_window, retest=rl.curriculum_retest,
                             pass_reward=rl.curriculum_pass_reward, seed=seed,
                             key=rl.curriculum_key, solved_rate=rl.curriculum_solved_rate,
                             reads=rl.curriculum_reads)
