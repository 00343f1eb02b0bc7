"""Building a pretrain or SFT phase's state once, before its first step: the environment, the
trainer (tasks/build.py), the training sequences and the eval engine.

Not a stage (nothing is persisted): flows/supervised.py calls `open_supervised` and keeps the
result for the whole phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.core.config import options_from
from rlpipe.engines.base import Engine
from rlpipe.envs.base import Environment, Example
from rlpipe.tasks.build import build, start_point, supervised_plan
from rlpipe.tasks.evaluate import EvalOptions, StepEvals, eval_step
from rlpipe.tasks.setup import max_context, pretrain_data, sft_data, stop_token_ids, task_env
from rlpipe.training.batch import Sequence
from rlpipe.training.trainer import Trainer


@dataclass
class SupervisedRun:
    """The trainer's state of one pretrain/SFT phase (local to the flow)."""

    trainer: Trainer
    loss_fn: Any
    tokenizer: Any
    env: Environment
    sequences: list[Sequence]
    eval_engine: Engine
    eval_examples: list[Example]
    start_step: int
    max_new_tokens: int
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """model.chat_template_kwargs (evals render prompts as RL does)."""
    sampled: EvalOptions = EvalOptions()
    """`[eval]`: sampled evals beside the greedy one (pass@k)."""
    max_thinking_tokens: int = 0
    """rl.sampling.max_thinking_tokens (evals keep RL's thinking budget)."""

    @property
    def model(self):
        """The trained model's whole weights (evals and checkpoints read them)."""
        return self.trainer.model

    def evaluate(self, step: int, *, run_dir: Path, run_id: str) -> StepEvals:
        """Greedy held-out accuracy of the trainer's weights at `step` (the `evals` table; a
        resumed step's stored evals are read back, `stored`)."""
        return eval_step(self.eval_engine, self.tokenizer, self.env, self.eval_examples, run_dir=run_dir,
                         run_id=run_id, step=step, max_new_tokens=self.max_new_tokens,
                         stop_token_ids=stop_token_ids(self.tokenizer), max_context=max_context(self.model),
                         template_kwargs=self.template_kwargs, max_thinking_tokens=self.max_thinking_tokens,
                         sampled=self.sampled)


def open_supervised(config, phase: str, run_dir: Path, start_checkpoint: str | None) -> SupervisedRun:
    """Build (or restore, from the run's newest checkpoint) everything `phase` (pretrain | sft) needs."""
    section = getattr(config, phase)
    chat_kwargs = config.model.chat_template_kwargs
    env = task_env(config.task, reward_models=False)
    built = build(config, supervised_plan(config, phase), start_point(config, run_dir, start_checkpoint))
    if phase == "pretrain":
        sequences = pretrain_data(env, built.tokenizer, section, config.seed)
    else:
        sequences = sft_data(env, built.tokenizer, section.examples, config.seed,
                             max_len=min(max_context(built.model), section.optim.token_budget),
                             data_path=section.data_path, sources=section.data, template_kwargs=chat_kwargs)
    return SupervisedRun(trainer=built.trainer, loss_fn=built.loss_fn, tokenizer=built.tokenizer, env=env,
                         sequences=sequences, eval_engine=built.eval_engine,
                         eval_examples=list(env.examples("eval", seed=config.seed))[: config.task.eval_examples],
                         start_step=built.start_step, max_new_tokens=config.rl.sampling.max_new_tokens,
                         template_kwargs=chat_kwargs, max_thinking_tokens=config.rl.sampling.max_thinking_tokens,
                         sampled=options_from(EvalOptions, config.eval))
