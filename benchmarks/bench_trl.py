"""rlpipe's `rl` flow against TRL's GRPOTrainer: seconds per optimizer step and reward, same setup.

Both sides start from the same weights: a short SFT (rlpipe's `sft` flow, 200 steps) of the
`small-dense` preset (3.2M parameters, about the size of the model in the TRL anchor) on the demo's task
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
  `dapo`, rlpipe's `token`), every group kept (rlpipe: rl.filter.drop_zero_variance = false, no
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
so under `runs.<precision>.trl.error`, and no TRL figure is reported. This module drives the
runs and compares them; what each child process runs is benchmarks/trl_sides.py.

    python -m benchmarks.bench_trl [--steps 20] [--seeds 5] [--lr 1e-4] [--sft-steps 200]
        [--preset small-dense] [--max-new-tokens 16] [--threads 1] [--precisions fp32 bf16]
        [--eval-samples 8] [--margin 0.02] [--start SFT_CHECKPOINT] [--out runs/bench/trl.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.paired_stats import pooled_median, reward_verdict, summarize_eval
from benchmarks.results import machine_platform, write_results
from benchmarks.trl_sides import (
    GROUP_SIZE,
    PROMPTS_PER_STEP,
    ROOT,
    TAIL_STEPS,
    rl_optim,
    run_eval,
    run_rlpipe,
    run_sft,
    run_trl,
    seeds,
    task_section,
)


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
    write_results(args.child_out, result)


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
    from rlpipe.models.loading import bf16_autocast_supported

    if bf16_autocast_supported(torch.device("cpu")):
        return None
    return "this CPU has no fast bf16 (rlpipe would fall back to fp32, TRL would emulate bf16): not compared"


def run(args: argparse.Namespace) -> dict:
    """Per precision: both sides interleaved seed by seed from the same SFT checkpoint (made first
    unless --start names one); then the common evaluator over all final weights."""
    from rlpipe.models.presets import build_model, count_parameters
    from rlpipe.models.tokenizer import build_tokenizer

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
        "anchor": {"source": "TRL's GRPOTrainer measured alone", "trl_version": "1.16", "model": "3.7M dense",
                   "completions": 64, "completion_tokens": 16, "seconds_per_step": [0.72, 0.85],
                   "target": "rlpipe step <= half of TRL's, reward no worse"},
        "machine": {"platform": machine_platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
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
    write_results(args.out, report)
    print_table(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
