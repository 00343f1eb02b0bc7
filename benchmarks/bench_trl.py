"""rlpipe's `rl` flow against TRL's GRPOTrainer: seconds per optimizer step and reward, same setup.

Both sides start from the same weights: a short SFT (rlpipe's `sft` flow, 200 steps) of the
`small-dense` preset (3.2M parameters, the size of ECOSYSTEM.md's TRL anchor) on the demo's task
at 1-2 digits (reversed digits, a teacher that forgets 30% of carries), which reaches ~50% greedy
accuracy, so rewards vary from the first step. Then each side runs `--steps` optimizer steps of
the same algorithm, on CPU, in its own process:

- 8 prompts x 8 completions per step, temperature 1, at most `--max-new-tokens` new tokens,
  stopping at <|im_end|> or <|endoftext|>;
- advantage = reward - group mean (no std scaling), no KL (beta = 0), on-policy (one optimizer
  step per batch, so TRL's ratio is 1), loss normalised by the step's completion tokens (TRL's
  `dapo`, rlpipe's `token`), every group kept (rlpipe: drop_zero_variance = false, no
  over-sampling; TRL never drops groups);
- the same optimizer and schedule: rlpipe's AdamW + warmup/cosine, handed to TRL as `optimizers`;
- the same precision, once in fp32 and once under bf16 autocast (rlpipe's `bf16_autocast`, TRL's
  `bf16=True`), and the same number of torch threads.

rlpipe runs its real Prefect flow (embedded API, Parquet tables, MLflow on a temporary SQLite
store); the seconds of its stage functions alone (no Prefect, Parquet or MLflow) are reported too.
A step's time runs from the end of one optimizer step to the end of the next (TRL: `on_step_end`;
rlpipe: the end of the step's metrics logging), median over steps 2 .. N-1 (the first warms up,
rlpipe's last evaluates and checkpoints). Reward: the mean training reward of the last 5 steps,
and greedy accuracy on the same 200 held-out prompts after the last step, computed by the same
evaluator (rlpipe's `evaluate_greedy`) for both models. One run per side: the timings are as
noisy as the machine.

TRL is the `bench` extra (`pip install -e '.[bench]'`). When it is missing or fails, the JSON says
so under `runs.<precision>.trl.error`, and no TRL figure is reported.

    python -m benchmarks.bench_trl [--steps 20] [--sft-steps 200] [--preset small-dense]
        [--max-new-tokens 16] [--threads 1] [--precisions fp32 bf16] [--out runs/bench/trl.json]
"""

from __future__ import annotations

import argparse
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
    reaches ~50% greedy accuracy: every group of 8 then has reward variance, and both sides
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
    config["model"]["bf16_autocast"] = True  # only the shared starting point: fast is fine
    config["sft"] = {"steps": args.sft_steps, "sequences_per_step": 64, "examples": 4000,
                     "optim": {"lr": 2e-3, "warmup_steps": 30, "min_lr_ratio": 1.0, "token_budget": 8192}}
    return config


def rl_optim(args: argparse.Namespace) -> dict:
    return {"lr": args.lr, "warmup_steps": 2, "min_lr_ratio": 0.1, "token_budget": 8192, "normaliser": "token",
            "max_grad_norm": 1.0}


def rl_config(args: argparse.Namespace, root: Path, start: str) -> dict:
    config = base_config(args, root)
    config["flow"] = "rl"
    config["model"]["path"] = start
    config["run_name"] = f"bench-trl-rl-{'bf16' if args.bf16 else 'fp32'}"
    config["rl"] = {
        "steps": args.steps, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
        "oversample_factor": 1.0, "max_attempts": 1, "drop_zero_variance": False, "estimator": "grpo",
        "normalize_std": False, "loss": "reinforce", "eval_every": 0, "checkpoint_every": 0,
        "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens},
        "optim": rl_optim(args),
    }
    return config


# ------------------------------------------------------------------------------------- rlpipe


def run_rlpipe(args: argparse.Namespace, root: Path) -> dict:
    """The timed `rl` flow from `--start`; without one, first the SFT that makes the shared start."""
    from benchmarks.bench_rl_step import Event, instrument, isolate, split_steps

    isolate(root)
    from flows.rl import rl_flow
    from flows.sft import sft_flow
    from storage.writer import read_table

    start, start_accuracy = args.start, None
    if not start:
        sft = sft_flow(config=sft_config(args, root))
        start, start_accuracy = sft["checkpoint"], sft["eval"].get("eval/accuracy")
    events: list[Event] = []
    config = rl_config(args, root, start)
    started = time.perf_counter()
    with instrument(events):
        result = rl_flow(config=config)
    seconds = time.perf_counter() - started
    steps = split_steps(events)
    run_dir = Path(config["runs_root"]) / config["run_name"]
    groups = read_table(run_dir, "groups").to_pylist()
    rollouts = read_table(run_dir, "rollouts").to_pylist()
    reward_by_step = [statistics.mean(g["reward_mean"] for g in groups if g["step"] == s)
                      for s in range(1, args.steps + 1)]
    return {
        "start_checkpoint": start,
        "start_eval_accuracy": start_accuracy,
        "seconds_per_step": median_window([s["wall"] for s in steps]),
        "seconds_per_step_functions_only": median_window([s["function"] for s in steps]),
        "stage_function_seconds": {stage: median_window([s[f"function_{stage}"] for s in steps])
                                   for stage in ("generate", "score", "filter", "pack", "train")},
        "seconds_per_step_all": [round(s["wall"], 4) for s in steps],
        "flow_seconds": seconds,
        "reward_by_step": reward_by_step,
        "reward_last": statistics.mean(reward_by_step[-TAIL_STEPS:]),
        "completion_tokens_mean": statistics.mean(r["n_completion_tokens"] for r in rollouts),
        "eval_accuracy": result["eval"].get("eval/accuracy"),
        "how": "rl flow (Prefect tasks, Parquet tables, MLflow), TorchEngine sampling",
    }


# ---------------------------------------------------------------------------------------- TRL


def trl_dataset(env, n: int, seed: int):
    """Conversational prompts of the env's first `n` train examples, with their ids."""
    from datasets import Dataset

    examples = [env.examples("train", seed=seed)[i] for i in range(n)]
    rows = {"prompt": [env.reset(e) for e in examples], "example_id": [e.example_id for e in examples]}
    return Dataset.from_dict(rows), {e.example_id: e for e in examples}


def make_reward(env, by_id: dict):
    """A TRL reward function scoring completions with the env's verifier."""

    def arithmetic_reward(completions, example_id, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(env.reward(by_id[i], text).reward) for text, i in zip(texts, example_id, strict=True)]

    return arithmetic_reward


def run_trl(args: argparse.Namespace, root: Path, start: str) -> dict:
    import torch
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engines.torch_engine import TorchEngine
    from flows.config import OptimConfig
    from models.loading import load_model
    from models.tokenizer import load_tokenizer
    from tasks.evaluate import evaluate_greedy
    from tasks.setup import make_env, make_optimizer, max_context, stop_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    task = task_section(args)
    env = make_env(task["env"], task["options"])
    model, tokenizer = load_model(start), load_tokenizer(start)
    optimizer, scheduler = make_optimizer(model, OptimConfig(**rl_optim(args)), args.steps)
    dataset, by_id = trl_dataset(env, max(2000, args.steps * PROMPTS_PER_STEP), args.seed)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    config = GRPOConfig(
        output_dir=str(root / "trl"), max_steps=args.steps, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        gradient_accumulation_steps=1, num_generations=GROUP_SIZE, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, scale_rewards="none", loss_type="dapo",
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=args.bf16,
        seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(env, by_id), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], optimizers=(optimizer, scheduler))
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    per_step = [b - a for a, b in itertools.pairwise(clock.ends)]
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [float(entry["reward"]) for entry in logs]
    lengths = [float(entry["completions/mean_length"]) for entry in logs if "completions/mean_length" in entry]
    model.eval()
    eval_examples = list(env.examples("eval", seed=args.seed))[: args.eval_examples]
    _, metrics = evaluate_greedy(TorchEngine(model), tokenizer, env, eval_examples, run_id="trl", step=args.steps,
                                 max_new_tokens=args.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer),
                                 max_context=max_context(model))
    return {
        "version": trl.__version__,
        "seconds_per_step": median_window(per_step),
        "seconds_per_step_all": [round(s, 4) for s in per_step],
        "train_seconds": seconds,
        "reward_by_step": rewards,
        "reward_last": statistics.mean(rewards[-TAIL_STEPS:]) if rewards else None,
        "completion_tokens_mean": statistics.mean(lengths) if lengths else None,
        "eval_accuracy": metrics["eval/accuracy"],
        "how": "GRPOTrainer, transformers generate (no vLLM), beta=0, loss_type=dapo, scale_rewards=none",
    }


# ------------------------------------------------------------------------------------- driver


def child(args: argparse.Namespace) -> None:
    """One side, in its own process; writes its JSON to --child-out (an `error` when it fails)."""
    root = Path(args.workdir)
    try:
        if args.child == "rlpipe":
            result = run_rlpipe(args, root)
        else:
            result = run_trl(args, root, args.start)
    except Exception as error:  # noqa: BLE001 - the report must say what failed, not crash the suite
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    Path(args.child_out).write_text(json.dumps(result, indent=2, default=str))


def spawn(args: argparse.Namespace, side: str, workdir: Path, start: str = "") -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{side}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_trl", "--child", side, "--workdir", str(workdir),
           "--child-out", str(out), "--start", start, "--steps", str(args.steps), "--sft-steps", str(args.sft_steps),
           "--preset", args.preset, "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
           "--lr", str(args.lr), "--eval-examples", str(args.eval_examples), "--seed", str(args.seed)]
    if args.bf16:
        cmd.append("--bf16")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"{side} process exited with {proc.returncode}", "traceback": (proc.stderr or proc.stdout)[-4000:]}


def compare(rlpipe: dict, trl: dict) -> dict:
    if "error" in rlpipe or "error" in trl or not trl.get("seconds_per_step"):
        return {}
    ratio = rlpipe["seconds_per_step"] / trl["seconds_per_step"]
    return {
        "step_time_ratio": ratio,
        "speedup": 1 / ratio,
        "meets_half_step_time": ratio <= 0.5,
        "reward_last_delta": rlpipe["reward_last"] - trl["reward_last"],
        "eval_accuracy_delta": rlpipe["eval_accuracy"] - trl["eval_accuracy"],
    }


def run(args: argparse.Namespace) -> dict:
    """Per precision: rlpipe, then TRL, each in its own process, from the same SFT checkpoint
    (made by the first rlpipe process)."""
    from models.presets import build_model, count_parameters
    from models.tokenizer import build_tokenizer

    load_start = os.getloadavg()
    parameters = count_parameters(build_model(args.preset, vocab_size=len(build_tokenizer()), seed=0))
    runs, start, start_accuracy = {}, "", None
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-trl-") as tmp:
        workdir = Path(tmp)
        for precision in args.precisions:
            args.bf16 = precision == "bf16"
            rlpipe = spawn(args, "rlpipe", workdir / precision, start)
            if not start:
                start, start_accuracy = rlpipe.get("start_checkpoint", ""), rlpipe.get("start_eval_accuracy")
            trl = (spawn(args, "trl", workdir / precision, start) if start
                   else {"error": "no SFT checkpoint: the rlpipe side failed before making one"})
            runs[precision] = {"rlpipe": rlpipe, "trl": trl, "comparison": compare(rlpipe, trl)}
    return {
        "benchmark": "trl",
        "settings": {"preset": args.preset, "parameters": parameters, "steps": args.steps,
                     "sft_steps": args.sft_steps, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                     "max_new_tokens": args.max_new_tokens, "lr": args.lr, "precisions": args.precisions,
                     "torch_threads": args.threads or "default", "eval_examples": args.eval_examples,
                     "reward_last_steps": TAIL_STEPS, "device": "cpu", "task": task_section(args)},
        "start": {"sft_steps": args.sft_steps, "eval_accuracy": start_accuracy},
        "runs": runs,
        "anchor": {"source": "ECOSYSTEM.md", "trl_version": "1.16", "model": "3.7M dense",
                   "completions": 64, "completion_tokens": 16, "seconds_per_step": [0.72, 0.85],
                   "target": "rlpipe step <= half of TRL's, reward no worse"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
    }


def print_table(report: dict) -> None:
    print(f"start: SFT accuracy {report['start']['eval_accuracy']}")
    print(f"{'side':<14}{'s/step':>9}{'reward(last)':>14}{'eval acc':>10}{'tokens':>8}")
    for precision, sides in report["runs"].items():
        for side in ("trl", "rlpipe"):
            row, name = sides[side], f"{side} {precision}"
            if "error" in row:
                print(f"{name:<14} failed: {row['error']}")
                continue
            print(f"{name:<14}{row['seconds_per_step']:>9.3f}{row['reward_last']:>14.3f}"
                  f"{row['eval_accuracy']:>10.3f}{row['completion_tokens_mean'] or 0:>8.2f}")
        if sides["comparison"]:
            print(f"rlpipe/TRL step time ({precision}): {sides['comparison']['step_time_ratio']:.2f} (target <= 0.5)")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--preset", default="small-dense")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (0: torch's default)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="fp32, and/or bf16 autocast on both sides")
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)  # a child's precision
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench/trl.json")
    parser.add_argument("--child", choices=["rlpipe", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--start", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return None
    if args.steps < 3:
        raise ValueError(f"--steps must be at least 3, got {args.steps}")
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
