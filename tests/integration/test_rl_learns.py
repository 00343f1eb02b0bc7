"""The RL core end to end without Prefect: engine → score → filter/advantages → pack → train.

A trivially learnable environment (reward = share of digits in the completion) must see
its mean reward rise well above the untrained policy's within a few dozen steps.
"""

from __future__ import annotations

import torch

from engines.base import SamplingParams
from engines.torch_engine import TorchEngine
from envs.base import Example, LazyExamples, SingleTurnEnv
from tasks.advantages import filter_and_advantages, scored_groups
from tasks.generate import generate_rollouts
from tasks.pack import pack_rollouts
from tasks.score import score_rollouts
from tasks.setup import make_model_and_tokenizer, stop_token_ids
from tasks.train import train_on_batches
from training.advantages import AdvantageConfig
from training.oversampling import BufferConfig, GroupBuffer
from training.rl_loss import build_rl_loss
from training.step import build_optimizer, build_scheduler


class LetterEnv(SingleTurnEnv):
    """Write digits: reward = share of digits among the completion's characters."""

    name = "letters"

    def examples(self, split, seed=0):
        return LazyExamples(1000, lambda i: Example(self.name, f"{split}/{i}", f"{i % 10}:", None))

    def score(self, example, completion_text):
        text = completion_text or " "
        return sum(c.isdigit() for c in text) / len(text)


def test_reinforce_raises_reward_on_a_learnable_env(tmp_path):
    torch.manual_seed(0)
    env = LetterEnv()
    model, tokenizer = make_model_and_tokenizer("tiny-dense", "", {}, seed=0)
    engine = TorchEngine(model)
    optimizer = build_optimizer(model, lr=3e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=40, min_lr_ratio=1.0)
    loss_fn = build_rl_loss("reinforce")
    buffer = GroupBuffer(BufferConfig(groups_per_batch=8, drop_zero_variance=False))
    advantage = AdvantageConfig(estimator="grpo")
    examples = list(env.examples("train"))
    by_id = {e.example_id: e for e in examples}
    params = SamplingParams(n=8, max_new_tokens=8, stop_token_ids=stop_token_ids(tokenizer))

    mean_rewards, rows_by_sample = [], {}
    for step in range(1, 41):
        buffer.start_batch(step - 1)
        decisions, rewards = [], []
        while buffer.need() > 0:
            attempt = buffer.begin_attempt()
            batch_examples = examples[(step * 16) % 960:][: buffer.prompts_to_sample()]
            rollouts = generate_rollouts(
                engine, tokenizer, env, batch_examples, params.__class__(**{**params.__dict__, "seed": step}),
                run_id="t", step=step, attempt=attempt, policy_version=step - 1, max_context=4096)
            scores = score_rollouts(env, by_id, rollouts, max_error_fraction=0.0)
            rewards += [s["reward"] for s in scores]
            rows_by_sample.update({r["sample_id"]: r for r in rollouts})
            decisions += buffer.add(scored_groups(rollouts, scores, attempt))
        selected, advantages, _, _, _ = filter_and_advantages(
            buffer, decisions, advantage, rows_by_sample, run_dir=tmp_path, run_id="t", step=step)
        batches, _ = pack_rollouts(selected, advantages, 2048, "t", step)
        train_on_batches(model, optimizer, scheduler, batches, loss_fn, normaliser="token",
                         max_grad_norm=1.0, autocast=False, step=step)
        if rewards:  # a step fed only by carried-over groups samples nothing new
            mean_rewards.append(sum(rewards) / len(rewards))

    start = sum(mean_rewards[:5]) / 5
    end = sum(mean_rewards[-5:]) / 5
    assert end > start + 0.3, (start, end, mean_rewards)
