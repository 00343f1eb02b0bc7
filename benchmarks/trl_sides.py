"""What benchmarks/bench_trl.py's child processes run: the run configs, rlpipe's side (its `sft`
and `rl` flows, timed by stage), TRL's side (GRPOTrainer with the same optimizer, prompts and
sampling), and the common evaluator that scores every final model alike. The module docstring of
bench_trl.py says what is compared and why each setting is what it is.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
TAIL_STEPS = 5


def median_window(values: list[float]) -> float | None:
    """Median of steps 2 .. N-1 (all of them when there are fewer than 3)."""
    window = values[1:-1] if len(values) >= 3 else values
    return statistics.median(window) if window else None


def task_section(args: argparse.Namespace) -> dict:
    """The demo's task (configs/demo.toml) at 1-2 digits and a milder teacher, so that a short SFT
    reaches ~60% greedy accuracy: most groups of 8 then have reward variance, and both sides
    train on every step."""
    with (ROOT / "configs" / "demo.toml").open("rb") as handle:
        task = tomllib.load(handle)["task"]
    task["options"].update(max_digits=2, teacher_carry_error=0.3, eval_size=400)
    task["eval_examples"] = args.eval_examples
    return task


def base_config(args: argparse.Namespace, root: Path) -> dict:
    return {
        "runs_root": str(root / "runs"), "seed": args.seed, "threads": args.threads,
        "model": {"preset": args.preset, "bf16_autocast": args.bf16},
        "task": task_section(args),
        "tracking": {"experiment": "rlpipe-bench-trl", "registered_model": "rlpipe-bench-trl", "report": False},
    }


def sft_config(args: argparse.Namespace, root: Path) -> dict:
    config = base_config(args, root)
    config.update(flow="sft", run_name="bench-trl-sft")
    # fp32: under bf16 autocast this lr-2e-3 SFT is chaotic (greedy accuracy 0.19-0.50 across
    # rounding-level changes to the attention kernels), which would move the start under the benchmark
    config["model"]["bf16_autocast"] = False
    config["sft"] = {"steps": args.sft_steps, "sequences_per_step": 64, "examples": 4000,
                     "optim": {"lr": 2e-3, "warmup_steps": 30, "min_lr_ratio": 1.0, "token_budget": 8192}}
    return config


def rl_optim(args: argparse.Namespace) -> dict:
    return {"lr": args.lr, "warmup_steps": 2, "min_lr_ratio": 0.1, "token_budget": 8192, "normaliser": "token",
            "max_grad_norm": 1.0}


def rl_config(args: argparse.Namespace, root: Path, start: str, seed: int) -> dict:
    config = base_config(args, root)
    config.update(flow="rl", seed=seed, run_name=f"bench-trl-rl-{'bf16' if args.bf16 else 'fp32'}-seed{seed}")
    config["model"]["path"] = start
    config["rl"] = {
        "steps": args.steps, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
        "buffer": {"oversample_factor": 1.0, "max_attempts": 1}, "filter": {"drop_zero_variance": False},
        "advantages": {"estimator": "grpo", "normalize_std": False}, "loss": {"type": "reinforce"},
        "eval_every": 0, "checkpoint_every": 0,
        "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens},
        "optim": rl_optim(args),
    }
    return config


# ------------------------------------------------------------------------------------- rlpipe


def seeds(args: argparse.Namespace) -> list[int]:
    """The RL runs' seeds (prompt order and sampling): --seed, --seed + 1, ...; a per-seed child
    runs only its --run-seed."""
    if args.run_seed is not None:
        return [args.run_seed]
    return [args.seed + i for i in range(args.seeds)]


def run_sft(args: argparse.Namespace, root: Path) -> dict:
    """The shared SFT start (rlpipe's `sft` flow)."""
    from benchmarks.bench_rl_step import isolate

    isolate(root)
    from rlpipe.flows.sft import sft_flow

    sft = sft_flow(config=sft_config(args, root))
    return {"start_checkpoint": sft["checkpoint"], "start_eval_accuracy": sft["eval"].get("eval/accuracy")}


def run_rlpipe(args: argparse.Namespace, root: Path) -> dict:
    """The timed `rl` flow from `--start`, once per seed."""
    from benchmarks.bench_rl_step import isolate

    isolate(root)
    if not args.start:
        raise ValueError("the rlpipe side needs --start (the SFT checkpoint)")
    return {"seeds": [rlpipe_once(args, root, args.start, seed) for seed in seeds(args)],
            "how": "rl flow (Prefect tasks, Parquet tables, MLflow), TorchEngine sampling",
            "gradient_checkpointing": False}


@contextlib.contextmanager
def generation_autocast(enabled: bool):
    """bf16 runs: rlpipe's engine samples under the same autocast as its training step, as TRL's
    generate does under accelerate's autocast (the engine itself samples in the weights' dtype)."""
    if not enabled:
        yield
        return
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.models.loading import autocast_context

    original = TorchEngine.generate

    def generate(self, prompts, params):
        with autocast_context(next(self.model.parameters()).device, True):
            return original(self, prompts, params)

    TorchEngine.generate = generate
    try:
        yield
    finally:
        TorchEngine.generate = original


def rlpipe_once(args: argparse.Namespace, root: Path, start: str, seed: int) -> dict:
    from rlpipe.flows.rl import rl_flow
    from rlpipe.storage.writer import read_table

    from benchmarks.bench_rl_step import Event, instrument, split_steps

    events: list[Event] = []
    config = rl_config(args, root, start, seed)
    started = time.perf_counter()
    with instrument(events, []), generation_autocast(args.bf16):  # the writer probe is not reported here
        result = rl_flow(config=config)
    seconds = time.perf_counter() - started
    steps = split_steps(events)
    run_dir = Path(config["runs_root"]) / config["run_name"]
    groups = read_table(run_dir, "groups").to_pylist()
    rollouts = read_table(run_dir, "rollouts").to_pylist()
    reward_by_step = [statistics.mean(g["reward_mean"] for g in groups if g["step"] == s)
                      for s in range(1, args.steps + 1)]
    return {
        "seed": seed,
        "seconds_per_step": median_window([s["wall"] for s in steps]),
        "seconds_per_step_functions_only": median_window([s["function"] for s in steps]),
        "stage_function_seconds": {stage: median_window([s[f"function_{stage}"] for s in steps])
                                   for stage in ("generate", "score", "filter", "pack", "train")},
        "seconds_per_step_all": [round(s["wall"], 4) for s in steps],
        "seconds_per_step_functions_only_all": [round(s["function"], 4) for s in steps],
        "flow_seconds": seconds,
        "reward_by_step": reward_by_step,
        "reward_last": statistics.mean(reward_by_step[-TAIL_STEPS:]),
        "completion_tokens_mean": statistics.mean(r["n_completion_tokens"] for r in rollouts),
        "example_ids_by_step": [sorted({r["example_id"] for r in rollouts if r["step"] == s})
                                for s in range(1, args.steps + 1)],
        "flow_eval_accuracy": result["eval"].get("eval/accuracy"),
        "final_checkpoint": result["checkpoint"],
    }


# ---------------------------------------------------------------------------------------- TRL


def trl_dataset(env, n: int, seed: int):
    """Conversational prompts of the first `n` train examples in the order rlpipe's `rl` flow draws
    them (its PromptSource over the same examples and seed), with their ids: read unshuffled, both
    sides train on the same prompts at the same steps."""
    from datasets import Dataset
    from rlpipe.envs.prompts import PromptSource

    examples = PromptSource(env.examples("train", seed=seed), seed=seed).next_batch(n)
    rows = {"prompt": [env.reset(e) for e in examples], "example_id": [e.example_id for e in examples]}
    return Dataset.from_dict(rows), {e.example_id: e for e in examples}


def make_reward(env, by_id: dict, seen: list[list[str]]):
    """A TRL reward function scoring completions with the env's verifier; appends each call's
    (one step's) example ids to `seen`."""

    def arithmetic_reward(completions, example_id, **kwargs) -> list[float]:
        seen.append(sorted(set(example_id)))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(env.reward(by_id[i], text).reward) for text, i in zip(texts, example_id, strict=True)]

    return arithmetic_reward


def run_trl(args: argparse.Namespace, root: Path, start: str) -> dict:
    """GRPOTrainer from `start`, once per seed."""
    import torch
    import trl

    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [trl_once(args, root, start, seed) for seed in seeds(args)]
    return {"version": trl.__version__, "seeds": runs,
            "effective_args": runs[0].pop("effective_args"),
            "gradient_checkpointing": runs[0].pop("gradient_checkpointing"),
            "how": "GRPOTrainer, transformers generate (no vLLM), beta=0, loss_type=dapo, scale_rewards=none, "
                   "gradient_checkpointing=False"}


def time_calls(obj, name: str) -> list[float]:
    """Wrap obj.<name> to record each call's seconds; returns the (growing) list."""
    seconds: list[float] = []
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return seconds


def trl_once(args: argparse.Namespace, root: Path, start: str, seed: int) -> dict:
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.tasks.setup import make_env, make_optimizer
    from rlpipe.training.config import OptimConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = task_section(args)
    env = make_env(task["env"], task["options"])
    model, tokenizer = load_model(start), load_tokenizer(start)
    optimizer, scheduler = make_optimizer(model, OptimConfig(**rl_optim(args)), args.steps)
    dataset, by_id = trl_dataset(env, args.steps * PROMPTS_PER_STEP, seed)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    clock, seen = StepClock(), []
    config = GRPOConfig(
        output_dir=str(root / f"trl-seed{seed}"), max_steps=args.steps, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        gradient_accumulation_steps=1, num_generations=GROUP_SIZE, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, scale_rewards="none", loss_type="dapo",
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=args.bf16,
        seed=seed, shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        # TRL 1.16 defaults this to True (recompute every forward in backward); rlpipe does not checkpoint
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(env, by_id, seen), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], optimizers=(optimizer, scheduler))
    checkpointing = bool(getattr(trainer.model, "is_gradient_checkpointing", False))
    if checkpointing:
        raise RuntimeError("TRL's model has gradient checkpointing on despite gradient_checkpointing=False")
    generate_seconds = time_calls(trainer, "_generate_and_score_completions")
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    per_step = [b - a for a, b in itertools.pairwise(clock.ends)]
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [float(entry["reward"]) for entry in logs]
    lengths = [float(entry["completions/mean_length"]) for entry in logs if "completions/mean_length" in entry]
    final = root / f"trl-final-seed{seed}"
    trainer.model.save_pretrained(str(final))  # the common evaluator loads it like rlpipe's checkpoint
    return {
        "seed": seed,
        "seconds_per_step": median_window(per_step),
        "seconds_per_step_all": [round(s, 4) for s in per_step],
        # sampling + scoring (transformers generate) vs the rest of the step (forward, backward, step)
        "stage_function_seconds": {"generate": median_window(generate_seconds),
                                   "train": median_window([t - g for t, g in zip(per_step, generate_seconds,
                                                                                  strict=False)])},
        "train_seconds": seconds,
        "reward_by_step": rewards,
        "reward_last": statistics.mean(rewards[-TAIL_STEPS:]) if rewards else None,
        "completion_tokens_mean": statistics.mean(lengths) if lengths else None,
        "final_checkpoint": str(final),
        "example_ids_by_step": seen,
        "effective_args": {k: v for k, v in trainer.args.to_dict().items() if k not in ("output_dir", "logging_dir")},
        "gradient_checkpointing": checkpointing,
    }


# ------------------------------------------------------------------------- common evaluator


def evaluate_checkpoint(path: str, tokenizer, env, examples: list, *, samples: int, max_new_tokens: int,
                        seed: int) -> dict:
    """Greedy correctness and the mean of `samples` temperature-1 rewards, per prompt, of the
    checkpoint at `path` (fp32, rlpipe's TorchEngine, fixed seed: the same evaluator for every model).

    Returns {"correct": [n], "sampled": [n]} (one float per example, in order).
    """
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.models.loading import load_model
    from rlpipe.rollouts.generation import encode_prompts
    from rlpipe.tasks.setup import max_context, stop_token_ids

    model = load_model(path).eval()
    engine, stops = TorchEngine(model), stop_token_ids(tokenizer)
    prompts = encode_prompts(tokenizer, env, examples, max_context(model), max_new_tokens)

    def rewards(params: SamplingParams, field: str) -> list[list[float]]:
        out = []
        for example, completions in zip(examples, engine.generate(prompts, params), strict=True):
            results = [env.reward(example, tokenizer.decode(c.tokens, skip_special_tokens=True))
                       for c in completions]
            out.append([float(r.components.get("correct", r.reward >= 1.0)) if field == "correct"
                        else float(r.reward) for r in results])
        return out

    greedy = rewards(SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                    seed=seed), "correct")
    sampled = rewards(SamplingParams(n=samples, temperature=1.0, max_new_tokens=max_new_tokens,
                                     stop_token_ids=stops, seed=seed), "reward")
    return {"correct": [float(c[0] >= 1.0) for c in greedy], "sampled": [statistics.mean(r) for r in sampled]}


def run_eval(args: argparse.Namespace) -> dict:
    """Every checkpoint named in --eval-models ({name: path}, 'start' first), same prompts and seed."""
    import torch
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.tasks.setup import make_env

    if args.threads:
        torch.set_num_threads(args.threads)
    models = json.loads(args.eval_models)
    task = task_section(args)
    env = make_env(task["env"], task["options"])
    examples = list(env.examples("eval", seed=args.seed))[: args.final_eval_examples]
    tokenizer = load_tokenizer(models["start"])
    started = time.perf_counter()
    per_prompt = {name: evaluate_checkpoint(path, tokenizer, env, examples, samples=args.eval_samples,
                                            max_new_tokens=args.max_new_tokens, seed=args.seed)
                  for name, path in models.items() if path}
    return {"per_prompt": per_prompt, "examples": len(examples), "seconds": time.perf_counter() - started}
