"""Sandboxed code RL that learns: configs/code.toml (SFT on a teacher whose demonstrations are
70% plausible wrong solutions, then RL judged by hidden unit tests run in the sandbox), 3 seeds.
Reported per seed: the held-out greedy pass rate (mean share of hidden tests passed,
`eval/reward_mean`) and the share of tasks passing every test (`eval/accuracy`) after SFT and at
each RL eval, the gain RL gives over SFT against the target (+10 points on every seed), each
phase's wall seconds (target: SFT and RL within 15 min on 2 CPU cores) and the seed's CPU seconds
(this process and its sandboxes: the figure a shared machine does not inflate).

    python -m benchmarks.bench_code [--seeds 0 1 2] [--sft-steps N] [--rl-steps N]   # default: the config's steps

About 9 min per seed (SFT 7, RL 2; ~370 CPU seconds) on 2 CPU cores that other jobs shared; the
config's comment has the figures."""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import tomllib
from pathlib import Path

from benchmarks.results import write_results
from benchmarks.seed_curves import ROOT, pipeline_seed

CONFIG = "configs/code.toml"
TARGET_GAIN = 0.10
TARGET_SECONDS = 15 * 60


def cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children (the sandboxes) so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def config_steps() -> tuple[int, int]:
    """The SFT and RL steps of the shipped config (the benchmark's defaults)."""
    config = tomllib.loads((ROOT / CONFIG).read_text())
    return config["sft"]["steps"], config["rl"]["steps"]


def run(args: argparse.Namespace) -> dict:
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-code-"))
    seeds = []
    for seed in args.seeds:
        began = cpu_seconds()
        out = pipeline_seed(CONFIG, root, seed, sft={"steps": args.sft_steps}, rl={"steps": args.rl_steps})
        run_dir = out.pop("run_dir")  # a local folder: printed, not recorded
        seeds.append(out | {"gain": out["rl_reward"] - out["sft_reward"], "cpu_seconds": cpu_seconds() - began})
        print(f"seed {seed}: {run_dir}", flush=True)
        print(json.dumps({k: v for k, v in seeds[-1].items() if k != "curve"}), flush=True)
    met = all(s["gain"] >= TARGET_GAIN and s["sft_seconds"] + s["rl_seconds"] <= TARGET_SECONDS for s in seeds)
    return {"settings": {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "target_gain": TARGET_GAIN,
                         "target_seconds": TARGET_SECONDS}, "seeds": seeds, "met": met}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sft_steps, rl_steps = config_steps()
    parser.add_argument("--sft-steps", type=int, default=sft_steps, help="default: the config's")
    parser.add_argument("--rl-steps", type=int, default=rl_steps, help="default: the config's")
    parser.add_argument("--root", default="", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/code.json"))
    args = parser.parse_args(argv)
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    report = run(args)
    write_results(args.out, report)
    for s in report["seeds"]:
        print(f"seed {s['seed']}: held-out pass rate {s['sft_reward']:.3f} after SFT, {s['rl_reward']:.3f} after RL "
              f"({s['gain']:+.3f}; target {TARGET_GAIN:+.2f}) in {(s['sft_seconds'] + s['rl_seconds']) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
