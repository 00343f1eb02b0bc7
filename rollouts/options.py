"""The options of the rollout components, built from the `[rl]` section's sub-tables in one place.

Each component reads only its own frozen options: the group buffer (`BufferOptions`, with its
batch maker's `BatchMakerOptions`), the
advantage estimator (`AdvantageOptions`), the completions left out before grouping
(`DropOptions`); the rollout source holds them together with the few fields it reads itself.
The defaults and the meaning of every field are the `[rl]` section's (rollouts/config.py).

    options = rollout_options(config.rl)
    buffer = GroupBuffer(options.buffer)
    source = RolloutSource(options, prompts, buffer, stages, start_step=0, published_version=0)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.core.config import options_from
from rlpipe.rollouts.advantages import AdvantageOptions
from rlpipe.rollouts.batch_makers import BatchMakerOptions
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.curriculum import CurriculumOptions
from rlpipe.rollouts.distill import DistillOptions
from rlpipe.rollouts.fates import DropOptions
from rlpipe.rollouts.group_buffer import BufferOptions


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
    """The rollout components' options from the `[rl]` section's sub-tables (`options_from`:
    fields by name); `seed` (the run's) seeds the batch maker."""
    maker = options_from(BatchMakerOptions, rl.buffer, seed=seed, spec=rl.buffer.batch_maker,
                         staleness_limit=max(rl.buffer.max_staleness, rl.off_policy.max_steps))
    return RolloutOptions(
        steps=rl.steps, ppo_epochs=rl.loss.ppo_epochs, max_off_policy_steps=rl.off_policy.max_steps,
        buffer=options_from(BufferOptions, rl.buffer, rl.filter, rl, maker=maker,
                            max_off_policy_steps=rl.off_policy.max_steps),
        drops=options_from(DropOptions, rl.filter, rl.sampling),
        advantages=options_from(AdvantageOptions, rl.advantages, distill=options_from(DistillOptions, rl.distill)),
        partial_rollouts=rl.off_policy.partial_rollouts,
    )


def curriculum_options(rl: RLConfig, seed: int) -> CurriculumOptions:
    """The prompt curriculum's options ([rl.curriculum]) with the run's seed."""
    return options_from(CurriculumOptions, rl.curriculum, kind=rl.curriculum.type, seed=seed)
