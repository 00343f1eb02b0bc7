"""Async RL: the demo task with rl.off_policy.max_steps = 0, 1, 2, with the in-process engine (its
sampler in a thread of the trainer's process, `torch`, or in a child process, `process`:
engine.producer) and with one `rlpipe serve` engine in a separate process, side by side in one run.

One short SFT (demo shapes, fewer steps) gives the start checkpoint; each RL run then trains the
same number of steps from it (tracking off, stages as plain calls). Reported per run: RL wall
clock, completion tokens sampled per second of RL wall clock, end-to-end speedup over k = 0 of
the same engine (`process` is compared with the in-process k = 0, which has no producer), and the
final held-out greedy accuracy. On a CPU with few cores, generation and
training compete for the same cores, so the overlap can gain little; with a server on its own
cores (or a GPU) it is where async pays.

    python -m benchmarks.bench_async [--rl-steps 30] [--sft-steps 300] [--engines torch process serve]
                                     [--out runs/bench/async.json]
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


def demo_config(root: Path, name: str, sft_steps: int, rl_steps: int, rl: dict, engine: dict) -> dict:
    config = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    config.update(runs_root=str(root), run_name=name, threads=1)
    config["tracking"] = {"enabled": False, "report": False, "prefect_task_runs": False}
    config["sft"] = {**config["sft"], "steps": sft_steps, "eval_every": 0, "checkpoint_every": 0}
    config["task"]["eval_examples"] = 300
    config["rl"] = {**config["rl"], "steps": rl_steps, "eval_every": 0, "checkpoint_every": 0, **rl}
    config["engine"] = engine
    return config


def completion_tokens(run_dir: Path) -> int:
    import duckdb

    glob = str(run_dir / "tables" / "rollouts" / "step=*" / "*.parquet")
    return int(duckdb.sql(f"select coalesce(sum(n_completion_tokens), 0) from read_parquet('{glob}')").fetchall()[0][0])


def run(args: argparse.Namespace) -> dict:
    import torch
    from rlpipe.engines.serve_process import serve_url, start_serve, stop_processes
    from rlpipe.flows.rl import run_rl
    from rlpipe.flows.supervised import run_supervised
    from rlpipe.tasks.config import validate_config

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    sft_config = validate_config(demo_config(root, "sft", args.sft_steps, args.rl_steps, {}, {}))
    sft = run_supervised(sft_config, "sft")
    results = []
    for engine_name in args.engines:
        procs = []
        engine = {}
        if engine_name == "serve":
            procs.append(start_serve(sft["checkpoint"], "--allow-root", str(root)))
            engine = {"type": "http", "urls": [serve_url(procs[0])]}
        elif engine_name == "process":
            engine = {"producer": "process"}
        try:
            for k in args.ks:
                if engine_name == "process" and k == 0:
                    continue  # no producer to place: the same run as the in-process k = 0
                config = validate_config(demo_config(root, f"{engine_name}-k{k}", args.sft_steps, args.rl_steps,
                                                     {"off_policy": {"max_steps": k}}, engine))
                start = time.perf_counter()
                out = run_rl(config, start_checkpoint=sft["checkpoint"])
                seconds = time.perf_counter() - start
                tokens = completion_tokens(config.run_dir / "rl")
                results.append({"engine": engine_name, "k": k, "seconds": seconds, "completion_tokens": tokens,
                                "tokens_per_second": tokens / seconds,
                                "accuracy": out["eval"].get("eval/accuracy")})
                print(json.dumps(results[-1]), flush=True)
        finally:
            stop_processes(procs)
    for r in results:
        same = "torch" if r["engine"] == "process" else r["engine"]
        base = next((b for b in results if b["engine"] == same and b["k"] == 0), r)
        r["speedup"] = base["seconds"] / r["seconds"]
    return {"settings": {"rl_steps": args.rl_steps, "sft_steps": args.sft_steps, "ks": args.ks,
                         "sft_accuracy": sft["eval"].get("eval/accuracy")}, "runs": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engines", nargs="+", default=["torch", "process", "serve"],
                        choices=["torch", "process", "serve"])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/async.json"))
    args = parser.parse_args(argv)
    from rlpipe.core.environment import quiet_defaults

    quiet_defaults()
    report = run(args)
    write_results(args.out, report)
    for r in report["runs"]:
        print(f"{r['engine']:>6} k={r['k']}  {r['seconds']:7.1f} s  {r['tokens_per_second']:8.0f} tok/s  "
              f"x{r['speedup']:.2f}  acc {r['accuracy']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
