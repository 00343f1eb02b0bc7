"""Building a run's rollout source once, before its first step: the prompt stream, the group
buffer, the curriculum and the stages of a sampling round, each from its own `[rl]` table, with
what a resumed run restores (the checkpoint's data_state, the curriculum's pass history).

    source = open_source(config.rl, SourceInputs(env, engines, tokenizer, ...), start_step=0, data_state={})
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Engine, SamplingParams
from rlpipe.envs.base import Environment
from rlpipe.envs.mixture import prompt_source, train_pool
from rlpipe.rollouts.advantages import overlong_penalty
from rlpipe.rollouts.config import RLConfig, SamplingConfig, ScoringConfig
from rlpipe.rollouts.curriculum import (
    Curriculum,
    CurriculumOptions,
    PassHistory,
    class_keys,
    history_rows,
)
from rlpipe.rollouts.generation import GenerateOptions, thinking_budget
from rlpipe.rollouts.group_buffer import GroupBuffer
from rlpipe.rollouts.options import curriculum_options, rollout_options
from rlpipe.rollouts.scoring import RemoteScoring, ScoreOptions
from rlpipe.rollouts.source import RolloutSource
from rlpipe.rollouts.stages import RunStages


@dataclass(frozen=True)
class SourceInputs:
    """What the rollout source samples with and where it records: built by the run's setup."""

    env: Environment
    engines: list[Engine]
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    max_context: int
    """The model's context: a prompt plus its completion must fit."""
    run_dir: Path
    run_id: str
    seed: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """model.chat_template_kwargs (prompts render as the chat template is told)."""
    remote_scoring: RemoteScoring | None = None
    """Where the reward calls run in batches ([cluster], tasks/cluster.py), or None: in process."""
    teacher: Any = None
    """On-policy distillation: the teacher that scores every sampled token (rollouts/distill.py)."""


def overlong_penalty_fn(scoring: ScoringConfig, max_new_tokens: int) -> Callable[[int], float] | None:
    """DAPO's soft overlong penalty as a function of the completion length, or None when off."""
    if scoring.overlong_buffer == 0:
        return None
    return functools.partial(overlong_penalty, max_length=max_new_tokens, buffer_length=scoring.overlong_buffer,
                             factor=scoring.overlong_penalty)


def sampling_params(sampling: SamplingConfig, group_size: int, tokenizer: Any,
                    stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """How each prompt of a round is sampled ([rl.sampling], the group size, the turn's stop tokens)."""
    return SamplingParams(n=group_size, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_new_tokens=sampling.max_new_tokens, stop_token_ids=stop_token_ids,
                          **thinking_budget(tokenizer, sampling.max_thinking_tokens))


def open_curriculum(options: CurriculumOptions, run_dir: Path, start_step: int, pool=()) -> Curriculum:
    """The prompt curriculum of a run starting after `start_step`: a resumed run's pass history is
    rebuilt from its own tables through that step (what the stopped run had there); keyed by
    class, each prompt's class is read from the run's prompt `pool`."""
    if not options.enabled or start_step == 0:
        return Curriculum(options)
    rows = history_rows(run_dir, through_step=start_step)
    key_of = None
    if options.key == "class":
        classes = class_keys(pool, {(env, example_id) for env, example_id, _ in rows}, options)
        key_of = lambda key: classes.get(key, key)  # noqa: E731
    return Curriculum(options, PassHistory.from_rows(rows, options.window, options.pass_reward, key_of))


def open_source(rl: RLConfig, inputs: SourceInputs, *, start_step: int, published_version: int,
                data_state: dict) -> RolloutSource:
    """The run's rollout source after `start_step` (0: a new run); a resumed run's prompt order
    and buffer come back from the checkpoint's `data_state`."""
    prompts = prompt_source(inputs.env, inputs.seed, pool=rl.prompt_pool)
    options = rollout_options(rl, seed=inputs.seed)
    buffer = GroupBuffer(options.buffer)
    if data_state:
        prompts.load_state_dict(data_state["prompts"])
        buffer.load_state_dict(data_state["buffer"])
    params = sampling_params(rl.sampling, rl.group_size, inputs.tokenizer, inputs.stop_token_ids)
    stages = RunStages(engines=inputs.engines, tokenizer=inputs.tokenizer, env=inputs.env,
                       generating=GenerateOptions(params, max_context=inputs.max_context, seed=inputs.seed,
                                                  template_kwargs=inputs.template_kwargs, teacher=inputs.teacher),
                       scoring=ScoreOptions(rl.scoring.max_reward_error_fraction,
                                            overlong_penalty_fn(rl.scoring, rl.sampling.max_new_tokens),
                                            inputs.remote_scoring),
                       run_dir=inputs.run_dir, run_id=inputs.run_id)
    curriculum = open_curriculum(curriculum_options(rl, inputs.seed), inputs.run_dir, start_step,
                                 train_pool(inputs.env, inputs.seed, rl.prompt_pool))
    return RolloutSource(options, prompts, buffer, stages, start_step=start_step,
                         published_version=published_version, curriculum=curriculum)
