"""Building an RL run's state once, before its first step: model, optimizer, loss, engines (the
one builder, tasks/build.py), and the rollout source (rollouts/source_setup.py), with what a resume
restores.

Not a stage (nothing is persisted): flows/rl.py calls `open_rl` and keeps the
result for the whole run; `close` releases the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.core.config import options_from
from rlpipe.engines.base import Engine
from rlpipe.envs.base import Environment, Example
from rlpipe.rollouts.source import RolloutSource
from rlpipe.rollouts.source_setup import SourceInputs, open_source
from rlpipe.storage.layout import mark_env_partitioned
from rlpipe.tasks.build import build, rl_plan, start_point
from rlpipe.tasks.cluster import ClusterScoring, open_cluster
from rlpipe.tasks.evaluate import EvalOptions, eval_step
from rlpipe.tasks.setup import max_context, stop_token_ids, task_env
from rlpipe.tasks.sync import sync_task
from rlpipe.training.trainer import Trainer


@dataclass
class RLRun:
    """The trainer's state of one RL run (local to the flow, passed explicitly to stages)."""

    trainer: Trainer
    """Model, optimizer, scheduler and how a step trains (one process or data-parallel)."""
    tokenizer: Any
    loss_fn: Any
    env: Environment
    engines: list[Engine]
    eval_engine: Engine
    eval_examples: list[Example]
    source: RolloutSource
    start_step: int
    stop_token_ids: tuple[int, ...]
    max_context: int
    max_new_tokens: int
    closing: list[Engine] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """model.chat_template_kwargs (evals render prompts as rollouts do)."""
    sampled: EvalOptions = EvalOptions()
    """`[eval]`: sampled evals beside the greedy one (pass@k)."""
    max_thinking_tokens: int = 0
    """rl.sampling.max_thinking_tokens (evals keep the rollouts' thinking budget)."""
    cluster: ClusterScoring | None = None
    """The cluster the score stage sends its reward calls to ([cluster]), or None."""

    @property
    def model(self):
        """The trained model's whole weights (engines, evals and checkpoints read them)."""
        return self.trainer.model

    def evaluate(self, step: int, *, run_dir: Path, run_id: str) -> dict[str, float]:
        """Greedy held-out accuracy of the trainer's weights at `step` (the `evals` table)."""
        return eval_step(self.eval_engine, self.tokenizer, self.env, self.eval_examples, run_dir=run_dir,
                         run_id=run_id, step=step, max_new_tokens=self.max_new_tokens,
                         stop_token_ids=self.stop_token_ids, max_context=self.max_context,
                         template_kwargs=self.template_kwargs, max_thinking_tokens=self.max_thinking_tokens,
                         sampled=self.sampled).metrics

    @property
    def needs_checkpoint_to_sync(self) -> bool:
        """Whether an engine reloads weights from a checkpoint folder (not in-process)."""
        return any(e.syncs_from_checkpoint for e in self.engines)

    def close(self) -> None:
        """Close every engine once, then the cluster (a local one is stopped), then the
        environment (its MCP servers, if any)."""
        try:
            for engine in self.closing:
                engine.close()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.close()
            finally:
                close_env(self.env)


def open_rl(config, run_dir: Path, run_id: str, start_checkpoint: str | None) -> RLRun:
    """Build (tasks/build.py; or restore, from the run's newest checkpoint) everything the RL loop
    needs. The environment's MCP servers (task.mcp_servers) start first; `RLRun.close` stops them."""
    env = task_env(config.task, config.model.chat_template_kwargs, tools=True)
    cluster = None
    try:
        cluster = open_cluster(config.cluster)
        return _open_rl(config, env, cluster, run_dir, run_id, start_checkpoint)
    except BaseException:
        if cluster is not None:
            cluster.close()
        close_env(env)
        raise


def close_env(env) -> None:
    """Close an environment that holds resources (MCP servers: envs/mcp_tools.py); others have
    nothing to close."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _teacher(config, model, tokenizer):
    """The teacher of on-policy distillation: served (rl.distill.url), else in process beside
    the student (rl.teacher), else None."""
    if config.rl.distill.url:
        from rlpipe.tasks.teacher import served_teacher

        return served_teacher(config.rl, tokenizer)
    if not config.rl.teacher:
        return None
    from rlpipe.tasks.teacher import load_teacher

    return load_teacher(config.rl.teacher, config.runs_root, next(model.parameters()).device)


def _open_rl(config, env, cluster: ClusterScoring | None, run_dir: Path, run_id: str, start_checkpoint: str | None) -> RLRun:
    rl = config.rl
    chat_kwargs = config.model.chat_template_kwargs
    start = start_point(config, run_dir, start_checkpoint)
    built = build(config, rl_plan(config), start)
    if config.task.envs:  # a mixture's rollouts: step=<k>/env=<name>/ (storage/layout.py)
        mark_env_partitioned(run_dir)
    version = built.start_step * rl.loss.ppo_epochs
    # servers restart from a resumed checkpoint (its syncs rows are repaired), or take the
    # pipeline's SFT result, which no server was started from
    sync_from = start.resume if start.resume is not None else start_checkpoint
    if sync_from:
        sync_task(built.engines, str(sync_from), version, run_dir=run_dir, run_id=run_id, step=built.start_step,
                  retries=config.engine.retries, only_missing=True)
    stops, context = stop_token_ids(built.tokenizer), max_context(built.model)
    teacher = _teacher(config, built.model, built.tokenizer)
    closing = [*built.closing, *([teacher] if callable(getattr(teacher, "close", None)) else [])]  # a server's client
    inputs = SourceInputs(env=env, engines=built.engines, tokenizer=built.tokenizer, stop_token_ids=stops,
                          max_context=context, run_dir=run_dir, run_id=run_id, seed=config.seed,
                          template_kwargs=chat_kwargs, remote_scoring=cluster,
                          teacher=teacher)
    source = open_source(rl, inputs, start_step=built.start_step, published_version=version,
                         data_state=built.data_state if start.resume is not None else {})
    return RLRun(trainer=built.trainer, tokenizer=built.tokenizer, loss_fn=built.loss_fn, env=env,
                 engines=built.engines, eval_engine=built.eval_engine,
                 eval_examples=list(env.examples("eval", seed=config.seed))[: config.task.eval_examples],
                 source=source, start_step=built.start_step, stop_token_ids=stops, max_context=context,
                 max_new_tokens=rl.sampling.max_new_tokens, closing=closing, template_kwargs=chat_kwargs,
                 max_thinking_tokens=rl.sampling.max_thinking_tokens, cluster=cluster,
                 sampled=options_from(EvalOptions, config.eval))
