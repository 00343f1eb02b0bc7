"""The calculator agent learns: configs/multiturn.toml (SFT, then multi-turn RL of a tiny model that
must learn to call a calculator tool), 3 seeds. Reported per seed: held-out greedy accuracy after
SFT and at each RL eval (with the completions sampled so far), the share of sampled episodes that
called the tool in the last RL step, and each phase's seconds.

    python -m benchmarks.bench_multiturn [--seeds 0 1 2] [--sft-steps 400] [--rl-steps 40] [--eval-examples 200]

About 10 min per seed on 2 idle CPU cores (the config's own figure).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.results import write_results
from benchmarks.seed_curves import pipeline_seed

CONFIG = "configs/multiturn.toml"
TOOL_SQL = """
SELECT avg(CASE WHEN list_contains(list_transform(from_json(messages, '["json"]'), lambda m: m ->> '$.role'), 'tool')
               THEN 1.0 ELSE 0.0 END) AS tool_share
FROM rollouts WHERE step = (SELECT max(step) FROM rollouts)
"""


def one_seed(root: Path, seed: int, args: argparse.Namespace) -> dict:
    from rlpipe.storage.queries import run_sql

    sections = {"sft": {"steps": args.sft_steps}, "rl": {"steps": args.rl_steps},
                "task": {"eval_examples": args.eval_examples}}
    out = pipeline_seed(CONFIG, root, seed, **sections)
    return out | {"tool_share_last_step": run_sql([Path(out["run_dir"])], TOOL_SQL).to_pylist()[0]["tool_share"]}


def run(args: argparse.Namespace) -> dict:
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-multiturn-"))
    seeds = []
    for seed in args.seeds:
        seeds.append(one_seed(root, seed, args))
        print(json.dumps({k: v for k, v in seeds[-1].items() if k != "curve"}), flush=True)
    return {"settings": {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
                         "eval_examples": args.eval_examples}, "seeds": seeds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--root", default="", help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/multiturn.json"))
    args = parser.parse_args(argv)
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    report = run(args)
    write_results(args.out, report)
    for s in report["seeds"]:
        print(f"seed {s['seed']}: held-out {s['sft_accuracy']} after SFT, {s['rl_accuracy']} after RL; "
              f"tool called in {s['tool_share_last_step']:.0%} of the last step's episodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
