"""The RL core end to end without Prefect or tables: the rollout source (engine → score →
filter/advantages) → pack → train, synchronous (k = 0) and one step ahead (k = 1).

A trivially learnable environment (reward = share of digits in the completion) must see
its mean reward rise well above the untrained policy's within a few dozen steps.
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.snapshot import SnapshotEngine
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.envs.prompts import PromptSource
from rlpipe.rollouts.config import RLConfig
from rlpipe.rollouts.group_buffer import GroupBuffer
from rlpipe.rollouts.options import rollout_options
from rlpipe.rollouts.source import RolloutSource
from rlpipe.tasks.pack import pack_rollouts
from rlpipe.tasks.setup import make_model_and_tokenizer, stop_token_ids
from rlpipe.tasks.train import train_on_batches
from rlpipe.training.policy_loss import policy_loss_fn
from rlpipe.training.step import StepOptions, build_optimizer, build_scheduler
from rlpipe.training.trainer import LocalTrainer, TrainOptions

from benchmarks.bench_losses import MemoryStages, digits_env


@pytest.mark.parametrize("ahead", [0, 1])
def test_reinforce_raises_reward_on_a_learnable_env(ahead):
    torch.manual_seed(0)
    env = digits_env()
    model, tokenizer = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    engine = SnapshotEngine(model) if ahead else TorchEngine(model)
    optimizer = build_optimizer(model, lr=3e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=40, min_lr_ratio=1.0)
    rl = RLConfig(steps=40, prompts_per_step=8, group_size=8, filter={"drop_zero_variance": False},
                  off_policy={"max_steps": ahead})
    loss_fn = policy_loss_fn(rl.policy_loss())
    trainer = LocalTrainer(model, optimizer, scheduler, TrainOptions(
        step=StepOptions(normaliser="token", autocast=False, entropy=True), max_grad_norm=1.0))
    params = SamplingParams(n=8, max_new_tokens=8, stop_token_ids=stop_token_ids(tokenizer), seed=0)
    stages = MemoryStages(engine, tokenizer, env, params)
    options = rollout_options(rl)
    source = RolloutSource(options, PromptSource(env.examples("train"), seed=0), GroupBuffer(options.buffer), stages,
                           start_step=0, published_version=0)
    lags = []
    with source:
        for step in range(1, rl.steps + 1):
            batch = source.batch(step)
            lags.append(batch.metrics["rollout/policy_lag_max"])
            batches = pack_rollouts(batch.samples, 2048)
            train_on_batches(trainer, batches, loss_fn, step=step)
            engine.sync(None, step)
            source.publish(step)

    mean_rewards = [sum(r) / len(r) for _, r in sorted(stages.rewards.items())]
    start = sum(mean_rewards[:5]) / 5
    end = sum(mean_rewards[-5:]) / 5
    assert end > start + 0.3, (start, end, mean_rewards)
    assert max(lags) <= ahead
