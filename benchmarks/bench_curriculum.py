"""The pass-rate curriculum on the demo: the RL phase of configs/demo.toml with rl.curriculum.type
"none" and "pass_rate", side by side from the same SFT checkpoint, same seeds.

One SFT (the demo's, or fewer steps) gives the start checkpoint; each RL run then trains the
demo's RL phase from it (tracking off, stages as plain calls): the demo as it is, then with the
curriculum keyed by prompt class (rl.curriculum.key = "class": the demo's prompts never come back,
so a per-prompt history has nothing to act on, but their classes of digits and carries do), and
with `--pool N` also on a pool of N train prompts (rl.prompt_pool) without and with the curriculum
keyed by example. Reported per run, read back from the run's tables: the share of sampled completions
whose group had zero reward variance (they train nothing), completions sampled per trained
completion, prompts the curriculum skipped, the held-out greedy accuracy on the demo's 1,000
eval problems, and the RL phase's wall clock.

    python -m benchmarks.bench_curriculum [--sft-steps 700] [--rl-steps 120] [--window 32] [--solved-rate 0.85]
                                          [--retest 0.02] [--reads 1] [--pool 0]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tomllib
from pathlib import Path

from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]


def demo_config(root: Path, name: str, sft_steps: int, rl_steps: int, rl: dict) -> dict:
    """configs/demo.toml with its own run folder, tracking off, `rl` fields over the demo's."""
    config = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    config.update(runs_root=str(root), run_name=name)
    config["tracking"] = {"enabled": False, "report": False, "prefect_task_runs": False}
    config["sft"] = {**config["sft"], "steps": sft_steps, "eval_every": 0, "checkpoint_every": 0}
    config["rl"] = {**config["rl"], "steps": rl_steps, "eval_every": 0, "checkpoint_every": 0, **rl}
    return config


FIGURES_SQL = """
SELECT count(*) AS sampled,
       count(*) FILTER (WHERE status = 'zero_variance') AS zero_variance,
       count(*) FILTER (WHERE status = 'trained') AS trained
FROM fates
"""


def figures(run_dir: Path) -> dict:
    """Sampled, zero-variance and trained completions of an RL run, and the prompts it skipped."""
    from rlpipe.storage.catalog import has_data
    from rlpipe.storage.queries import run_sql

    row = run_sql([run_dir], FIGURES_SQL).to_pylist()[0]
    skipped = 0
    if has_data([run_dir], "curriculum"):
        skipped = run_sql([run_dir], "select count(*) filter (where status = 'skipped') as n from curriculum"
                          ).to_pylist()[0]["n"]
    return {**row, "skipped_prompts": int(skipped),
            "zero_variance_share": row["zero_variance"] / max(row["sampled"], 1),
            "sampled_per_trained": row["sampled"] / max(row["trained"], 1)}


def run(args: argparse.Namespace) -> dict:
    import torch
    from rlpipe.flows.rl import run_rl
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-curriculum-"))
    start, sft_accuracy = args.start, None
    if not start:
        sft = run_supervised(validate_config(demo_config(root, "sft", args.sft_steps, args.rl_steps, {})), "sft")
        start, sft_accuracy = sft["checkpoint"], sft["eval"].get("eval/accuracy")
    results = []
    for rl in run_settings(args.pool, args.retest, args.window, args.solved_rate, args.reads):
        curriculum = rl["curriculum"]
        label = (f"{curriculum['type']}"
                 f"{', by ' + curriculum.get('key', 'example') if curriculum['type'] != 'none' else ''}"
                 f", pool {rl.get('prompt_pool') or 'all'}")
        config = validate_config(demo_config(root, f"rl-{len(results)}", args.sft_steps, args.rl_steps, rl))
        began = time.perf_counter()
        out = run_rl(config, start_checkpoint=str(start))
        seconds = time.perf_counter() - began
        results.append({"run": label, "curriculum": curriculum["type"], "prompt_pool": rl.get("prompt_pool", 0),
                        "seconds": seconds, "accuracy": out["eval"].get("eval/accuracy"),
                        **figures(config.run_dir / "rl")})
        print(json.dumps(results[-1]), flush=True)
    return {"settings": {"rl_steps": args.rl_steps, "sft_steps": args.sft_steps, "sft_accuracy": sft_accuracy,
                         "retest": args.retest, "window": args.window, "solved_rate": args.solved_rate,
                         "reads": args.reads,
                         "target_zero_variance_share": 0.4, "target_accuracy": 0.99}, "runs": results}


def run_settings(pool: int, retest: float, window: int, solved_rate: float, reads: float) -> list[dict]:
    """The `[rl]` fields of each run: the demo as it is and with the curriculum keyed by class;
    with `pool`, the same on a pool of `pool` train prompts without and with the curriculum keyed
    by example (what the pool does alone, and what the per-prompt history adds)."""
    runs = [{"curriculum": {"type": "none"}},
            {"curriculum": {"type": "pass_rate", "key": "class", "window": window, "solved_rate": solved_rate,
                            "retest": retest, "reads": reads}}]
    if pool:
        runs += [{"curriculum": {"type": "none"}, "prompt_pool": pool},
                 {"curriculum": {"type": "pass_rate", "retest": retest}, "prompt_pool": pool}]
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=700)
    parser.add_argument("--rl-steps", type=int, default=120)
    parser.add_argument("--pool", type=int, default=0, help="also runs on rl.prompt_pool = N, keyed by example")
    parser.add_argument("--retest", type=float, default=0.02, help="rl.curriculum.retest of the curriculum runs")
    parser.add_argument("--window", type=int, default=32, help="rl.curriculum.window of the run keyed by class")
    parser.add_argument("--solved-rate", type=float, default=0.85,
                        help="rl.curriculum.solved_rate of the run keyed by class")
    parser.add_argument("--reads", type=float, default=1.0, help="rl.curriculum.reads of the run keyed by class")
    parser.add_argument("--start", default="", help="an SFT checkpoint to start from (skips the SFT)")
    parser.add_argument("--root", default="", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/curriculum.json"))
    args = parser.parse_args(argv)
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    report = run(args)
    write_results(args.out, report)
    for r in report["runs"]:
        print(f"{r['run']:>28}  zero-variance {r['zero_variance_share']:6.1%}  sampled/trained "
              f"{r['sampled_per_trained']:5.2f}  acc {r['accuracy']}  {r['seconds']:6.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
