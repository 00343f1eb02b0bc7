"""Does each RL loss learn? Reward gain of every `rl.loss.type` (and a KL variant), two tasks.

The RL core without Prefect (engine → score → filter/advantages → pack → train, the functions the
`rl` flow's stages call); per loss and seed: 8 prompts x 8 completions per step, GRPO advantages
(r − mean, every group kept), one optimizer step per batch, each loss with its own normaliser
(`training.rl_loss.loss_normaliser`). Tasks (`--task`):

- `digits`: from a random `tiny-dense` start, reward = share of digits among 8 new characters
  (prompt "<d>:"), lr 3e-3. Any working policy-gradient loss saturates it within ~30 steps.
- `arithmetic` (demo scale): bench_trl's setup. The `small-dense` preset after a short SFT
  (benchmarks.trl_sides.sft_config; or --start) on the demo's task at 1-2 digits, lr 1e-4, 16 new
  tokens; the gain is in greedy accuracy on 400 held-out prompts (rlpipe's TorchEngine), next to
  the training reward.

Gain in training reward = mean of the last 5 steps − the first 5. Entropy is logged per step
(training/entropy.py), so a loss that collapses shows it. On-policy (one step per batch) the
ratio-based losses start at ratio 1, where ppo_clip, cispo and reinforce give the same gradient:
they differ only once the engine's log-probs drift from the trainer's.

    python -m benchmarks.bench_losses [--task digits|arithmetic] [--steps 40] [--seeds 2]
        [--losses reinforce gspo ...] [--start SFT_CHECKPOINT] [--out runs/bench/losses.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import machine_platform, write_results

VARIANTS = {  # name → (rl.loss.type, other [rl.loss] options): a KL variant next to the plain losses
    "reinforce": ("reinforce", {}),
    "ppo_clip": ("ppo_clip", {}),
    "gspo": ("gspo", {}),
    "cispo": ("cispo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "reinforce+kl": ("reinforce", {"kl_coef": 0.05, "kl_estimator": "k3"}),
}
TAIL = 5


def digits_env():
    from rlpipe.envs.base import Example, LazyExamples
    from rlpipe.envs.single_turn import SingleTurnEnv

    class DigitsEnv(SingleTurnEnv):
        """Write digits: reward = share of digits among the completion's characters."""

        name = "digits"

        def examples(self, split, seed=0):
            return LazyExamples(1000, lambda i: Example(self.name, f"{split}/{i}", f"{i % 10}:", None))

        def score(self, example, completion_text):
            text = completion_text or " "
            return sum(c.isdigit() for c in text) / len(text)

    return DigitsEnv()


TASKS = {  # task → (lr, max_new_tokens)
    "digits": (3e-3, 8),
    "arithmetic": (1e-4, 16),
}


def arithmetic_env():
    from rlpipe.tasks.setup import make_env

    from benchmarks.trl_sides import task_section

    task = task_section(argparse.Namespace(eval_examples=400))
    return make_env(task["env"], task["options"])


def make_start(task: str, seed: int, start: str):
    """(model, tokenizer, env) for a task: a random tiny-dense (digits) or the SFT checkpoint."""
    from rlpipe.tasks.setup import make_model_and_tokenizer

    if task == "digits":
        return (*make_model_and_tokenizer("tiny-dense", "", {}, seed=seed), digits_env())
    return (*make_model_and_tokenizer("small-dense", start, {}, seed=seed), arithmetic_env())


def greedy_accuracy(model, tokenizer, env, max_new_tokens: int, n: int = 400) -> float:
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.tasks.evaluate import evaluate_greedy
    from rlpipe.tasks.setup import max_context, stop_token_ids

    examples = list(env.examples("eval", seed=0))[:n]
    rows, _ = evaluate_greedy(TorchEngine(model.eval()), tokenizer, env, examples, run_id="b", step=0,
                              max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer),
                              max_context=max_context(model))
    model.train()
    return statistics.mean(float(r["correct"]) for r in rows)


class MemoryStages:
    """The rollout source's stages without tables: sampling rounds straight from the engine, the
    rewards of every round kept per step."""

    def __init__(self, engine, tokenizer, env, params):
        self.engine, self.tokenizer, self.env, self.params = engine, tokenizer, env, params
        self.rewards: dict[int, list[float]] = {}
        self.env_examples: dict = {}  # example_id → Example, of every round scored

    def generate(self, examples, *, step, attempt, policy_version, previous):
        from rlpipe.engines.base import SamplingParams
        from rlpipe.rollouts.generation import GenerateOptions, SampleRound, generate_rollouts

        params = SamplingParams(**{**self.params.__dict__, "seed": self.params.seed * 10_000 + step * 10 + attempt})
        return generate_rollouts(self.engine, self.tokenizer, self.env, examples,
                                 GenerateOptions(params, max_context=4096),
                                 SampleRound(run_id="b", step=step, attempt=attempt, policy_version=policy_version))

    def score(self, examples, rollouts, *, step, previous):
        from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts

        self.env_examples.update(examples)
        scores = score_rollouts(self.env, examples, rollouts, ScoreOptions(max_error_fraction=0.0))
        self.rewards.setdefault(step, []).extend(s.reward for s in scores)
        return scores

    def select(self, fill, rows, options, *, step, empty):
        from rlpipe.rollouts.fates import select_step

        return select_step(fill, rows, options, step=step)


def learning_run(variant: str, seed: int = 0, steps: int = 40, task: str = "digits", start: str = "",
                 prompts: int = 8, group: int = 8) -> dict:
    """One RL run of `variant` (a VARIANTS key) on `task`: mean reward and entropy per step, the
    gain, and for arithmetic the greedy accuracy before and after. The loss comes from the run
    config's [rl] section (`RLConfig.policy_loss`, `training.policy_loss.policy_loss_fn`), as in the `rl` flow."""
    import torch
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.envs.prompts import PromptSource
    from rlpipe.rollouts.config import RLConfig
    from rlpipe.rollouts.group_buffer import GroupBuffer
    from rlpipe.rollouts.options import rollout_options
    from rlpipe.rollouts.source import RolloutSource
    from rlpipe.tasks.pack import pack_rollouts
    from rlpipe.tasks.setup import stop_token_ids
    from rlpipe.tasks.train import train_on_batches
    from rlpipe.training.kl import frozen_copy
    from rlpipe.training.policy_loss import policy_loss_fn
    from rlpipe.training.rl_loss import loss_normaliser
    from rlpipe.training.step import StepOptions, build_optimizer, build_scheduler
    from rlpipe.training.trainer import LocalTrainer, TrainOptions

    name, options = VARIANTS[variant]
    lr, max_new_tokens = TASKS[task]
    torch.manual_seed(seed)
    model, tokenizer, env = make_start(task, seed, start)
    accuracy_start = greedy_accuracy(model, tokenizer, env, max_new_tokens) if task != "digits" else None
    rl = RLConfig(steps=steps, prompts_per_step=prompts, group_size=group, filter={"drop_zero_variance": False},
                  loss={"type": name, **options})
    ref = frozen_copy(model) if rl.loss.kl_coef else None
    engine = TorchEngine(model)
    optimizer = build_optimizer(model, lr=lr)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=steps, min_lr_ratio=0.1)
    loss_fn = policy_loss_fn(rl.policy_loss())
    normaliser, constant = loss_normaliser(name, "token", prompts * group, max_new_tokens)
    trainer = LocalTrainer(model, optimizer, scheduler, TrainOptions(
        step=StepOptions(normaliser=normaliser, constant=constant, autocast=False, entropy=True), max_grad_norm=1.0),
                           reference=ref)
    params = SamplingParams(n=group, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tokenizer),
                            seed=seed)
    stages = MemoryStages(engine, tokenizer, env, params)
    rollout = rollout_options(rl)
    source = RolloutSource(rollout, PromptSource(env.examples("train", seed=seed), seed=seed),
                           GroupBuffer(rollout.buffer), stages, start_step=0, published_version=0)
    rewards, entropies, started = [], [], time.perf_counter()
    with source:
        for step in range(1, steps + 1):
            batch = source.batch(step)
            batches = pack_rollouts(batch.samples, 8192)
            metrics = train_on_batches(trainer, batches, loss_fn, step=step)
            source.publish(step)
            rewards.append(statistics.mean(stages.rewards.get(step) or [0.0]))
            entropies.append(metrics.get("entropy"))
    seconds = time.perf_counter() - started
    first, last = statistics.mean(rewards[:TAIL]), statistics.mean(rewards[-TAIL:])
    out = {"variant": variant, "loss": name, "options": options, "task": task, "seed": seed,
           "reward_first": first, "reward_last": last, "gain": last - first, "rewards": rewards,
           "entropy": entropies, "seconds": seconds}
    if accuracy_start is not None:
        out["accuracy_start"] = accuracy_start
        out["accuracy_end"] = greedy_accuracy(model, tokenizer, env, max_new_tokens)
        out["accuracy_gain"] = out["accuracy_end"] - accuracy_start
    return out


def sft_start(root: Path) -> str:
    """bench_trl's SFT start (small-dense, 200 steps, fp32), made with the `sft` flow."""
    from benchmarks.bench_rl_step import isolate
    from benchmarks.trl_sides import sft_config

    root.mkdir(parents=True, exist_ok=True)
    isolate(root)
    from rlpipe.flows.sft import sft_flow

    args = argparse.Namespace(seed=0, threads=1, preset="small-dense", bf16=False, eval_examples=200, sft_steps=200)
    return sft_flow(config=sft_config(args, root))["checkpoint"]


def summarize(runs: list[dict]) -> list[dict]:
    """Per variant: mean gain over seeds, its range, the entropy over the first and the last 5
    steps, and (arithmetic) the greedy-accuracy gain."""
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        gains = [r["gain"] for r in mine]
        ent_first = [e for r in mine for e in r["entropy"][:TAIL] if e is not None]
        ent_last = [e for r in mine for e in r["entropy"][-TAIL:] if e is not None]
        accuracy = [r["accuracy_gain"] for r in mine if "accuracy_gain" in r]
        rows.append({"variant": variant, "seeds": len(mine), "gain_mean": statistics.mean(gains),
                     "gain_min": min(gains), "gain_max": max(gains),
                     "reward_first": statistics.mean(r["reward_first"] for r in mine),
                     "reward_last": statistics.mean(r["reward_last"] for r in mine),
                     "entropy_first": statistics.mean(ent_first) if ent_first else None,
                     "entropy_last": statistics.mean(ent_last) if ent_last else None,
                     "accuracy_gain_mean": statistics.mean(accuracy) if accuracy else None,
                     "accuracy_gain_by_seed": accuracy or None,
                     "seconds_per_run": statistics.mean(r["seconds"] for r in mine)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="digits")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--losses", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--start", default="", help="arithmetic: an SFT checkpoint (default: make bench_trl's)")
    parser.add_argument("--workdir", default="", help="where the SFT start is made (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench/losses.json")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-losses-") as tmp:
        start = args.start or (sft_start(Path(args.workdir or tmp)) if args.task == "arithmetic" else "")
        # interleaved by seed: background load falls on every loss alike
        runs = [learning_run(v, seed=s, steps=args.steps, task=args.task, start=start)
                for s in range(args.seeds) for v in args.losses]
    lr, max_new_tokens = TASKS[args.task]
    report = {"benchmark": "losses",
              "settings": {"task": args.task, "steps": args.steps, "seeds": args.seeds, "prompts_per_step": 8,
                           "group_size": 8, "lr": lr, "max_new_tokens": max_new_tokens, "threads": args.threads,
                           "start": "random tiny-dense" if args.task == "digits" else "bench_trl's SFT",
                           "gain": f"mean reward of the last {TAIL} steps - the first {TAIL}"},
              "results": summarize(runs), "runs": runs, "seconds": time.perf_counter() - started,
              "machine": {"platform": machine_platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}
    write_results(args.out, report)
    print_table(report["results"])
    return report


def print_table(rows: list[dict]) -> None:
    print(f"{'loss':<14}{'reward first5':>14}{'last5':>8}{'gain (min..max)':>24}{'entropy first..last':>22}"
          f"{'greedy acc gain':>17}")
    for row in rows:
        ent = (f"{row['entropy_first']:.2f} .. {row['entropy_last']:.2f}" if row["entropy_last"] is not None
               else "-")
        acc = f"{row['accuracy_gain_mean']:+.3f}" if row["accuracy_gain_mean"] is not None else "-"
        print(f"{row['variant']:<14}{row['reward_first']:>14.3f}{row['reward_last']:>8.3f}"
              f"{row['gain_mean']:>+10.3f} ({row['gain_min']:+.2f}..{row['gain_max']:+.2f}){ent:>22}{acc:>17}")


if __name__ == "__main__":
    main(sys.argv[1:])
