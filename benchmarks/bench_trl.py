"""rlpipe's `rl` flow against TRL's GRPOTrainer: seconds per optimizer step and reward, same setup.

Both sides start from the same weights: a short SFT (rlpipe's `sft` flow, 200 steps) of the
`small-dense` preset (3.2M parameters, the size of ECOSYSTEM.md's TRL anchor) on the demo's task
at 1-2 digits (reversed digits, a teacher that forgets 30% of carries), in fp32: a partly trained
start (greedy accuracy ~0.6, see `start`), so rewards vary from the first step. Then each side
runs `--steps` optimizer steps of the same algorithm, on CPU, once per seed (`--seeds`, default 5),
interleaved: per seed one rlpipe process and one TRL process, rlpipe first on even seeds and TRL
first on odd ones, so that the shared machine's drifting load falls on both sides alike.

- 8 prompts x 8 completions per step, temperature 1, at most `--max-new-tokens` new tokens,
  stopping at <|im_end|> or <|endoftext|>;
- the same prompts at the same steps: TRL reads, unshuffled, the prompts in the order rlpipe's
  PromptSource draws them for the seed (`same_prompts_each_step` checks it);
- advantage = reward - group mean (no std scaling), no KL (beta = 0), on-policy (one optimizer
  step per batch, so TRL's ratio is 1), loss normalised by the step's completion tokens (TRL's
  `dapo`, rlpipe's `token`), every group kept (rlpipe: drop_zero_variance = false, no
  over-sampling; TRL never drops groups); both compute the policy's entropy every step;
- the same optimizer and schedule: rlpipe's AdamW (lr 1e-4, 2 warmup steps, cosine to 0.1x,
  grad norm clipped at 1.0) handed to TRL as `optimizers`. At lr 5e-4 both sides' rewards fell
  over 20 steps (greedy accuracy 0.48 -> 0.24-0.31); at 2e-4 they rose on both but unevenly
  (0.58 and 0.73); at 1e-4 they rise steadily on both (0.48 -> 0.64-0.79 over seeds 0-2);
- no gradient checkpointing on either side: TRL 1.16's GRPOConfig turns it on by default (every
  forward recomputed in backward), so it is set off explicitly and checked on the model; TRL's
  effective arguments (`trainer.args`) are recorded under `runs.<precision>.trl.effective_args`;
- the same precision, fp32 and, where the CPU has fast bf16, bf16 autocast on both sides (rlpipe's
  `bf16_autocast`, TRL's `bf16=True`) with the same autocast scope: TRL generates under
  accelerate's autocast, so rlpipe's engine then samples under the training autocast too (a CPU
  without fast bf16 would run rlpipe in fp32 and TRL in emulated bf16: skipped, the JSON says so);
  the same number of torch threads.

Time: rlpipe runs its real Prefect flow (embedded API, Parquet tables, MLflow on a temporary
SQLite store); the seconds of its stage functions alone (no Prefect, Parquet or MLflow) are
reported too. A step's time runs from the end of one optimizer step to the end of the next (TRL:
`on_step_end`; rlpipe: the end of the step's metrics logging), median over steps 2 .. N-1 (the
first warms up, rlpipe's last evaluates and checkpoints), pooled over the seeds' runs.

Reward: after the last step, one evaluator process scores the start and every run's final weights
alike (fp32, rlpipe's TorchEngine, the same seed): greedy accuracy on the task's 400 held-out
prompts, and the mean reward of `--eval-samples` temperature-1 completions per prompt. Each
figure comes with a standard error that covers both the prompts and the run-to-run spread:
max(SE over prompts of the seed-averaged values, SE of the seeds' run means). rlpipe - TRL is
paired by seed and prompt and judged by non-inferiority (benchmarks/paired_stats.py): rlpipe is
'non-inferior' when the one-sided 95% lower bound of the difference in greedy accuracy clears
-`--margin` (default 0.02), 'inferior' when the upper bound is below it, else 'inconclusive'; the
90% confidence interval is reported with it. The training reward per step (mean over seeds) and
its last-5-step mean are kept; they are on different prompts from the eval and far noisier.

TRL is the `bench` extra (`pip install -e '.[bench]'`). When it is missing or fails, the JSON says
so under `runs.<precision>.trl.error`, and no TRL figure is reported.

    python -m benchmarks.bench_trl [--steps 20] [--seeds 5] [--lr 1e-4] [--sft-steps 200]
        [--preset small-dense] [--max-new-tokens 16] [--threads 1] [--precisions fp32 bf16]
        [--eval-samples 8] [--margin 0.02] [--start SFT_CHECKPOINT] [--out runs/bench/trl.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

from benchmarks.paired_stats import pooled_median, reward_verdict, summarize_eval

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
        "oversample_factor": 1.0, "max_attempts": 1, "drop_zero_variance": False, "estimator": "grpo",
        "normalize_std": False, "loss": "reinforce", "eval_every": 0, "checkpoint_every": 0,
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
    from flows.sft import sft_flow

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
    from engines.torch_engine import TorchEngine
    from models.loading import autocast_context

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
    from benchmarks.bench_rl_step import Event, instrument, split_steps
    from flows.rl import rl_flow
    from storage.writer import read_table

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

    from envs.prompts import PromptSource

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
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flows.config import OptimConfig
    from models.loading import load_model
    from models.tokenizer import load_tokenizer
    from tasks.setup import make_env, make_optimizer

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
    from engines.base import SamplingParams
    from engines.torch_engine import TorchEngine
    from models.loading import load_model
    from tasks.generate import encode_prompts
    from tasks.setup import max_context, stop_token_ids

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

    from models.tokenizer import load_tokenizer
    from tasks.setup import make_env

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



# ------------------------------------------------------------------------------------- driver


def child(args: argparse.Namespace) -> None:
    """One side (or the common evaluator), in its own process; writes its JSON to --child-out
    (an `error` when it fails)."""
    root = Path(args.workdir)
    try:
        if args.child == "sft":
            result = run_sft(args, root)
        elif args.child == "rlpipe":
            result = run_rlpipe(args, root)
        elif args.child == "trl":
            result = run_trl(args, root, args.start)
        else:
            result = run_eval(args)
    except Exception as error:  # noqa: BLE001 - the report must say what failed, not crash the suite
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    Path(args.child_out).write_text(json.dumps(result, indent=2, default=str))


def spawn(args: argparse.Namespace, side: str, workdir: Path, start: str = "", extra: list[str] = ()) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{side}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_trl", "--child", side, "--workdir", str(workdir),
           "--child-out", str(out), "--start", start, "--steps", str(args.steps), "--sft-steps", str(args.sft_steps),
           "--preset", args.preset, "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
           "--lr", str(args.lr), "--eval-examples", str(args.eval_examples), "--seed", str(args.seed),
           "--final-eval-examples", str(args.final_eval_examples), "--eval-samples", str(args.eval_samples),
           "--seeds", str(args.seeds), "--margin", str(args.margin), *extra]
    if args.bf16:
        cmd.append("--bf16")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"{side} process exited with {proc.returncode}", "traceback": (proc.stderr or proc.stdout)[-4000:]}


TIMING = ("seconds_per_step", "seconds_per_step_functions_only", "stage_function_seconds", "seconds_per_step_all",
          "flow_seconds", "train_seconds")


def side_summary(result: dict) -> dict:
    """A side's figures from its child's runs: seconds per step = median over the steps 2 .. N-1 of
    every seed's run (the stage split from the first seed's), training rewards averaged over the
    seeds (each seed's kept under `seeds`)."""
    if "error" in result:
        return result
    runs = result["seeds"]
    tails = [r["reward_last"] for r in runs if r["reward_last"] is not None]
    tokens = [r["completion_tokens_mean"] for r in runs if r["completion_tokens_mean"] is not None]
    return {
        **{key: result[key] for key in ("version", "how", "gradient_checkpointing", "effective_args") if key in result},
        **{key: runs[0][key] for key in TIMING if key in runs[0]},
        "timing_seed": runs[0]["seed"],
        "seconds_per_step": pooled_median(runs, "seconds_per_step_all"),
        "seconds_per_step_functions_only": pooled_median(runs, "seconds_per_step_functions_only_all"),
        "seconds_per_step_by_seed": [r["seconds_per_step"] for r in runs],
        "reward_by_step": [statistics.mean(step) for step in zip(*(r["reward_by_step"] for r in runs), strict=True)],
        "reward_last": statistics.mean(tails) if tails else None,
        "completion_tokens_mean": statistics.mean(tokens) if tokens else None,
        "seeds": [{key: value for key, value in r.items()
                   if key not in ("example_ids_by_step", "final_checkpoint", "seconds_per_step_all",
                                  "seconds_per_step_functions_only_all")} for r in runs],
    }


def same_prompts(rlpipe: dict, trl: dict) -> bool:
    """Whether both sides trained on the same prompts at every step of every seed."""
    return ("error" not in rlpipe and "error" not in trl
            and [r["example_ids_by_step"] for r in rlpipe["seeds"]] == [r["example_ids_by_step"] for r in trl["seeds"]])


def compare(rlpipe: dict, trl: dict, verdict: dict) -> dict:
    """Step time ratio, the training-reward tail delta, and the common evaluator's deltas with
    their standard errors (`verdict`)."""
    if "error" in rlpipe or "error" in trl or not trl.get("seconds_per_step"):
        return {}
    ratio = rlpipe["seconds_per_step"] / trl["seconds_per_step"]
    out = {
        "step_time_ratio": ratio,
        "speedup": 1 / ratio,
        "meets_half_step_time": ratio <= 0.5,
        "reward_last_delta": rlpipe["reward_last"] - trl["reward_last"],
    }
    if verdict:
        out |= {"eval_accuracy_delta": verdict["greedy_accuracy"]["delta"],
                "eval_accuracy_delta_se": verdict["greedy_accuracy"]["se"],
                "eval_accuracy_delta_ci90": verdict["greedy_accuracy"]["ci90"],
                "sampled_reward_delta": verdict["sampled_reward"]["delta"],
                "sampled_reward_delta_se": verdict["sampled_reward"]["se"],
                "sampled_reward_delta_ci90": verdict["sampled_reward"]["ci90"],
                "margin": verdict["margin"], "verdict": verdict["verdict"],
                "non_inferior": verdict["non_inferior"], "final_eval": verdict}
    return out


def final_evals(args: argparse.Namespace, workdir: Path, start: str, children: dict) -> tuple[dict, dict]:
    """The common evaluator over the start and every run's final weights, in one process:
    (summaries keyed 'start' and '<precision>/<side>', per-precision verdicts)."""
    models = {"start": start}
    for precision, sides in children.items():
        for side, result in sides.items():
            for run in result.get("seeds", []):
                models[f"{precision}/{side}/{run['seed']}"] = run["final_checkpoint"]
    result = spawn(args, "eval", workdir / "eval", start, ["--eval-models", json.dumps(models)])
    if "error" in result:
        return {"error": result["error"], "traceback": result.get("traceback")}, {}
    per_prompt, start_eval = result["per_prompt"], result["per_prompt"]["start"]
    runs = {f"{precision}/{side}": [per_prompt[f"{precision}/{side}/{seed}"] for seed in seeds(args)]
            for precision, sides in children.items() for side, child_result in sides.items()
            if "error" not in child_result}
    summaries = {name: summarize_eval(by_seed, start_eval) for name, by_seed in runs.items()}
    summaries |= {"start": summarize_eval([start_eval], None), "examples": result["examples"],
                  "seconds": result["seconds"]}
    verdicts = {precision: reward_verdict(runs[f"{precision}/rlpipe"], runs[f"{precision}/trl"], args.margin)
                for precision in children if {f"{precision}/rlpipe", f"{precision}/trl"} <= runs.keys()}
    return summaries, verdicts


def merge_seeds(results: list[dict]) -> dict:
    """One side's per-seed children as one result (the first error, if any, stands for all)."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    merged = {key: value for key, value in results[0].items() if key != "seeds"}
    merged["seeds"] = [run for r in results for run in r["seeds"]]
    return merged


def interleaved(args: argparse.Namespace, workdir: Path, start: str) -> dict:
    """Both sides, seed by seed, alternating which goes first (rlpipe first on even positions), each
    seed in its own process: slow drifts of the shared machine's load fall on both sides alike."""
    out: dict[str, list[dict]] = {"rlpipe": [], "trl": []}
    for i, seed in enumerate(seeds(args)):
        for side in ("rlpipe", "trl") if i % 2 == 0 else ("trl", "rlpipe"):
            out[side].append(spawn(args, side, workdir / f"seed{seed}", start, ["--run-seed", str(seed)]))
    return {side: merge_seeds(results) for side, results in out.items()}


def bf16_skip_reason() -> str | None:
    """Why a bf16 comparison would be unfair here: rlpipe falls back to fp32 where the CPU has no
    fast bf16, while TRL would still run (emulated) bf16 autocast."""
    import torch

    from models.loading import bf16_autocast_supported

    if bf16_autocast_supported(torch.device("cpu")):
        return None
    return "this CPU has no fast bf16 (rlpipe would fall back to fp32, TRL would emulate bf16): not compared"


def run(args: argparse.Namespace) -> dict:
    """Per precision: both sides interleaved seed by seed from the same SFT checkpoint (made first
    unless --start names one); then the common evaluator over all final weights."""
    from models.presets import build_model, count_parameters
    from models.tokenizer import build_tokenizer

    load_start = os.getloadavg()
    started = time.perf_counter()
    parameters = count_parameters(build_model(args.preset, vocab_size=len(build_tokenizer()), seed=0))
    children, skipped, start, flow_start_accuracy = {}, {}, args.start, None
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-trl-") as tmp:
        workdir = Path(tmp)
        if not start:
            sft = spawn(args, "sft", workdir / "sft")
            start, flow_start_accuracy = sft.get("start_checkpoint", ""), sft.get("start_eval_accuracy")
        for precision in args.precisions:
            reason = bf16_skip_reason() if precision == "bf16" else None
            if reason:
                skipped[precision] = reason
                continue
            args.bf16 = precision == "bf16"
            children[precision] = (interleaved(args, workdir / precision, start) if start else
                                   {side: {"error": "no SFT checkpoint: the SFT process failed"}
                                    for side in ("rlpipe", "trl")})
        args.bf16 = False  # the common evaluator runs fp32
        evals, verdicts = (final_evals(args, workdir, start, children) if start and children
                           else ({"error": "no SFT checkpoint or no precision compared"}, {}))
    runs = {}
    for precision, sides in children.items():
        runs[precision] = {side: side_summary(result) for side, result in sides.items()}
        for side, row in runs[precision].items():
            summary = evals.get(f"{precision}/{side}")
            if summary:  # the common evaluator's figures, next to the side's own
                row["final_eval"] = summary
                row["eval_accuracy"] = summary["greedy_accuracy"]
        runs[precision]["same_prompts_each_step"] = same_prompts(sides["rlpipe"], sides["trl"])
        runs[precision]["comparison"] = compare(runs[precision]["rlpipe"], runs[precision]["trl"],
                                                verdicts.get(precision, {}))
    start_eval = evals.get("start", {})
    return {
        "benchmark": "trl",
        "settings": {"preset": args.preset, "parameters": parameters, "steps": args.steps, "seeds": seeds(args),
                     "order": "interleaved: per seed one rlpipe and one TRL process, rlpipe first on even seeds",
                     "gradient_checkpointing": "off on both sides (TRL: GRPOConfig(gradient_checkpointing=False))",
                     "generation_autocast": {"fp32": "none on either side",
                                             "bf16": "bf16 autocast on both sides (rlpipe: its engine's generate "
                                                     "under the training autocast; TRL: accelerate's autocast "
                                                     "around forward)"},
                     "precisions_skipped": skipped,
                     "non_inferiority": {"margin": args.margin, "figure": "greedy accuracy (primary) and sampled "
                                         "reward", "test": "one-sided 95% lower bound of rlpipe - TRL > -margin; "
                                         "ci90 = two-sided 90% interval", "pairing": "seed and prompt"},
                     "sft_steps": args.sft_steps, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                     "max_new_tokens": args.max_new_tokens, "lr": args.lr, "optim": rl_optim(args),
                     "precisions": args.precisions, "torch_threads": args.threads or "default",
                     "eval_examples": args.eval_examples, "reward_last_steps": TAIL_STEPS, "device": "cpu",
                     "task": task_section(args), "start_checkpoint_given": bool(args.start),
                     "final_eval": {"examples": evals.get("examples"), "samples_per_prompt": args.eval_samples,
                                    "temperature": 1.0, "seed": args.seed, "dtype": "fp32",
                                    "engine": "rlpipe TorchEngine",
                                    "se": "max(SE over prompts, SE over seeds' run means)"}},
        "start": {"sft_steps": None if args.start else args.sft_steps,
                  "eval_accuracy": start_eval.get("greedy_accuracy", flow_start_accuracy),
                  "flow_eval_accuracy": flow_start_accuracy, "final_eval": start_eval},
        "runs": runs,
        "final_eval_seconds": evals.get("seconds"),
        "final_eval_error": evals.get("error"),
        "seconds": time.perf_counter() - started,
        "anchor": {"source": "ECOSYSTEM.md", "trl_version": "1.16", "model": "3.7M dense",
                   "completions": 64, "completion_tokens": 16, "seconds_per_step": [0.72, 0.85],
                   "target": "rlpipe step <= half of TRL's, reward no worse"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
    }


def pm(summary: dict, figure: str) -> str:
    return f"{summary[figure]:.3f}±{summary[figure + '_se']:.3f}"


def print_table(report: dict) -> None:
    start = report["start"].get("final_eval") or {}
    if "greedy_accuracy" in start:
        print(f"start: greedy acc {pm(start, 'greedy_accuracy')}, sampled reward {pm(start, 'sampled_reward')}")
    print(f"{'side':<12}{'s/step':>8}{'train reward(first..last 5)':>29}{'greedy acc':>14}{'sampled rwd':>14}"
          f"{'greedy gain':>14}")
    for precision, sides in report["runs"].items():
        for side in ("trl", "rlpipe"):
            row, name = sides[side], f"{side} {precision}"
            if "error" in row:
                print(f"{name:<12} failed: {row['error']}")
                continue
            rewards = row["reward_by_step"]
            curve = f"{statistics.mean(rewards[:TAIL_STEPS]):.3f} .. {row['reward_last']:.3f}"
            final = row.get("final_eval") or {}
            gain = final.get("gain_over_start", {}).get("greedy_accuracy")
            evals = (f"{pm(final, 'greedy_accuracy'):>14}{pm(final, 'sampled_reward'):>14}"
                     f"{gain['delta']:>+8.3f}±{gain['se']:.3f}" if final else "  (no final eval)")
            print(f"{name:<12}{row['seconds_per_step']:>8.3f}{curve:>29}{evals}")
        c = sides["comparison"]
        if c:
            print(f"rlpipe/TRL step time ({precision}): {c['step_time_ratio']:.2f} (target <= 0.5)")
        if c.get("final_eval"):
            v = c["final_eval"]
            for figure in ("greedy_accuracy", "sampled_reward"):
                f = v[figure]
                print(f"rlpipe-TRL ({precision}) {figure}: {f['delta']:+.3f}±{f['se']:.3f}, 90% CI "
                      f"[{f['ci90'][0]:+.3f}, {f['ci90'][1]:+.3f}], margin {v['margin']}: {f['verdict']}")
    print(f"total {report['seconds']:.0f} s")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--preset", default="small-dense")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-examples", type=int, default=200, help="the flows' own greedy evals")
    parser.add_argument("--final-eval-examples", type=int, default=400,
                        help="held-out prompts of the common evaluator (the task has 400)")
    parser.add_argument("--eval-samples", type=int, default=8, help="temperature-1 samples per prompt, common evaluator")
    parser.add_argument("--start", default="", help="an SFT checkpoint to start from (skips the SFT)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (0: torch's default)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="fp32, and/or bf16 autocast on both sides")
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)  # a child's precision
    parser.add_argument("--seed", type=int, default=0, help="the SFT's and the first RL run's seed")
    parser.add_argument("--seeds", type=int, default=5, help="RL runs per side and precision (seeds --seed, +1, ...)")
    parser.add_argument("--margin", type=float, default=0.02, help="non-inferiority margin (greedy accuracy)")
    parser.add_argument("--run-seed", type=int, default=None, help=argparse.SUPPRESS)  # a per-seed child's seed
    parser.add_argument("--out", default="runs/bench/trl.json")
    parser.add_argument("--child", choices=["sft", "rlpipe", "trl", "eval"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--eval-models", default="{}", help=argparse.SUPPRESS)  # the eval child's {name: path}
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return None
    if args.steps < 3:
        raise ValueError(f"--steps must be at least 3, got {args.steps}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
