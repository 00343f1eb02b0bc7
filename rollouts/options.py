"""The options of the rollout components, built from the `[rl]` section in one place.

Each component reads only its own frozen options: the group buffer (`BufferOptions`), the
advantage estimator (`AdvantageOptions`), the completions left out before grouping
(`DropOptions`); the rollout source holds them together with the few fields it reads itself.
The defaults and the meaning of every field are the `[rl]` section's.

    options = rollout_options(config.rl)
    buffer = GroupBuffer(options.buffer)
    source = RolloutSource(options, prompts, buffer, stages, start_step=0, published_version=0)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.rollouts.curriculum import CurriculumOptions
from rlpipe.rollouts.fates import DropOptions
from rlpipe.training.advantages import AdvantageOptions
from rlpipe.training.config import RLConfig
from rlpipe.training.oversampling import BufferOptions


@dataclass(frozen=True)
class RolloutOptions:
    """What the rollout source reads: the run's length and pace, and its components' options."""

    steps: int
    ppo_epochs: int
    max_off_policy_steps: int
    buffer: BufferOptions
    drops: DropOptions
    advantages: AdvantageOptions


def rollout_options(rl: RLConfig) -> RolloutOptions:
    """The rollout components' options from the `[rl]` config section."""
    return RolloutOptions(
        steps=rl.steps, ppo_epochs=rl.ppo_epochs, max_off_policy_steps=rl.max_off_policy_steps,
        buffer=BufferOptions(prompts_per_step=rl.prompts_per_step, oversample_factor=rl.oversample_factor,
                             max_attempts=rl.max_attempts, partial_batches=rl.partial_batches,
                             max_staleness=rl.max_staleness, max_off_policy_steps=rl.max_off_policy_steps,
                             drop_zero_variance=rl.drop_zero_variance),
        drops=DropOptions(drop_truncated=rl.drop_truncated, max_new_tokens=rl.sampling.max_new_tokens,
                          sample_filter=rl.sample_filter),
        advantages=AdvantageOptions(estimator=rl.estimator, normalize_std=rl.normalize_std,
                                    positive_only=rl.positive_only),
    )


def curriculum_options(rl: RLConfig, seed: int) -> CurriculumOptions:
    """The prompt curriculum's options (rl.curriculum, rl.curriculum_*) with the run's seed."""
    return CurriculumOptions(kind=rl.curriculum, window=rl.curriculum_window, retest=rl.curriculum_retest,
                             pass_reward=rl.curriculum_pass_reward, seed=seed,
                             key=rl.curriculum_key, solved_rate=rl.curriculum_solved_rate,
                             reads=rl.curriculum_reads)
