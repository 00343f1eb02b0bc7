"""On-policy distillation against RL on the demo, 3 seeds: from the same SFT checkpoint, the demo's
RL phase, and a student distilled from that RL run's last checkpoint (rl.teacher; [rl.distill]
type = "advantage", pure distillation). Reported per seed: both learning curves (held-out greedy
accuracy against completions sampled so far) and the completions each needed to reach the target
(95% held-out), and the seconds each phase took; both curves side by side in an SVG beside the JSON
(`--out` with .svg).

Per seed: the demo's SFT (configs/demo.toml, that seed), its RL phase from the SFT checkpoint
(the baseline curve; its last checkpoint is the teacher), then the distillation run from the same
SFT checkpoint with the same steps, prompts per step and eval schedule, and fewer completions per
prompt (`--distill-group-size`, 2): the teacher scores every token of every completion, so the
signal needs no group of rewards to compare against, and a step of distillation samples a
quarter of the demo's 8 per prompt.

    python -m benchmarks.bench_distill [--seeds 0 1 2] [--sft-steps 700] [--rl-steps 120] [--eval-every 10]
                                       [--eval-examples 1000] [--target 0.95] [--distill-group-size 2]

About 3 x (SFT + 2 RL phases) of the demo: some 45 min per seed on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.curve_svg import panels_svg
from benchmarks.results import write_atomic, write_results
from benchmarks.seed_curves import eval_curve, first_reaching, seeded_config

DEMO = "configs/demo.toml"


def phase_configs(root: Path, seed: int, args: argparse.Namespace) -> dict[str, dict]:
    """The seed's SFT, RL and distillation configs (the teacher is set once RL has run)."""
    common = {"sft": {"steps": args.sft_steps, "eval_every": 0, "checkpoint_every": 0},
              "task": {"eval_examples": args.eval_examples}}
    rl = {"steps": args.rl_steps, "eval_every": args.eval_every, "checkpoint_every": 0}
    distill = {**rl, "group_size": args.distill_group_size, "distill": {"type": "advantage"},
               "filter": {"drop_zero_variance": False}}
    return {"sft": seeded_config(DEMO, root, f"sft-{seed}", seed, **common),
            "rl": seeded_config(DEMO, root, f"rl-{seed}", seed, **common, rl=rl),
            "distill": seeded_config(DEMO, root, f"distill-{seed}", seed, **common, rl=distill)}


def one_seed(root: Path, seed: int, args: argparse.Namespace) -> dict:
    import torch
    from rlpipe.flows.rl import run_rl
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    configs = phase_configs(root, seed, args)
    out: dict = {"seed": seed}
    began = time.perf_counter()
    sft = run_supervised(validate_config(configs["sft"]), "sft")
    out["sft_seconds"], out["sft_accuracy"] = time.perf_counter() - began, sft["eval"].get("eval/accuracy")
    teacher = None
    for name in ("rl", "distill"):
        if name == "distill":
            configs[name]["rl"]["teacher"] = str(teacher)
        config = validate_config(configs[name])
        began = time.perf_counter()
        result = run_rl(config, start_checkpoint=str(sft["checkpoint"]))
        teacher = Path(result["checkpoint"])
        curve = eval_curve(config.run_dir / "rl")
        # recorded under --root: where the runs went is not part of the result
        out |= {f"{name}_seconds": time.perf_counter() - began,
                f"{name}_checkpoint": str(teacher.resolve().relative_to(root.resolve())),
                f"{name}_curve": curve, f"{name}_reached": first_reaching(curve, args.target)}
    return out


def run(args: argparse.Namespace) -> dict:
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-distill-"))
    seeds = []
    for seed in args.seeds:
        seeds.append(one_seed(root, seed, args))
        print(json.dumps({k: v for k, v in seeds[-1].items() if not k.endswith("_curve")}), flush=True)
    return {"settings": {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "eval_every": args.eval_every,
                         "eval_examples": args.eval_examples, "target": args.target,
                         "distill_group_size": args.distill_group_size}, "seeds": seeds}


def curves_svg(report: dict) -> str:
    """Both sides' learning curves side by side, one line per seed (benchmarks/curve_svg.py)."""
    panels = {title: {f"seed {s['seed']}": [(p["sampled"], p["accuracy"]) for p in s[f"{name}_curve"]]
                      for s in report["seeds"]}
              for name, title in (("rl", "RL from SFT"), ("distill", "distilled from the RL checkpoint"))}
    return panels_svg(panels, x_label="completions sampled", y_label="held-out accuracy",
                      target=report["settings"]["target"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=700)
    parser.add_argument("--rl-steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-examples", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy each side must reach")
    parser.add_argument("--distill-group-size", type=int, default=2,
                        help="completions per prompt of the distillation run (RL keeps the demo's)")
    parser.add_argument("--root", default="", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/distill.json"))
    args = parser.parse_args(argv)
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    report = run(args)
    write_results(args.out, report)
    write_atomic(args.out.with_suffix(".svg"), curves_svg(report))
    for s in report["seeds"]:
        sides = "  ".join(f"{name}: {s[f'{name}_reached']['sampled'] if s[f'{name}_reached'] else 'never'}"
                          for name in ("rl", "distill"))
        print(f"seed {s['seed']}: completions to {args.target:.0%} held-out  {sides}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
