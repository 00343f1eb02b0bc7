"""Score-stage throughput of the code environment: in process vs a local Dask cluster of 1, 2
and 4 worker processes ([cluster] runner = "dask"), and the per-batch overhead (a batch of one
rollout of an environment whose reward costs nothing, timed end to end, best of 5).

    python -m benchmarks.bench_cluster_scoring [--completions 128] [--batch-size 16] [--repeats 3] [--out PATH]

Each completion is the code task's reference solution, run in the sandbox against the task's
hidden tests (what the score stage does for a code run). Each setting scores the same round
`--repeats` times after one warm-up round that starts every worker's interpreter; the median
counts. Needs the `cluster` extra. The workers report each batch to a Prefect API: the one
PREFECT_API_URL names, else a temporary one this benchmark starts (not timed).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.flows.prefect_api import api_for_a_script
from rlpipe.rollouts.records import Rollout
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.tasks.cluster import open_cluster
from rlpipe.tasks.cluster_config import ClusterConfig

from benchmarks.results import machine_platform, write_results

WORKERS = (1, 2, 4)


def rollouts_of(env, n: int, answer) -> tuple[dict, list[Rollout]]:
    examples = list(env.examples("train")[:n])
    rows = [Rollout(run_id="b", step=1, policy_version=0, env="b", example_id=e.example_id, group_id=f"g{i}",
                    sample_id=f"s{i}", attempt=1, prompt_tokens=[], completion_tokens=[], completion_logprobs=[],
                    finish_reason="stop", prompt_text="", completion_text=answer(env, e), n_prompt_tokens=0,
                    n_completion_tokens=0) for i, e in enumerate(examples)]
    return {e.example_id: e for e in examples}, rows


def timed(env, examples, rollouts, remote) -> float:
    start = time.perf_counter()
    score_rollouts(env, examples, rollouts, ScoreOptions(1.0, remote=remote))
    return time.perf_counter() - start


def setting(name: str, workers: int, times: list[float], n: int, overhead: float | None = None) -> dict:
    seconds = statistics.median(times)
    return {"setting": name, "workers": workers, "seconds": seconds, "completions_per_second": n / seconds,
            "all": [n / t for t in times], "batch_overhead_ms": None if overhead is None else overhead * 1000}


def bench(completions: int, batch_size: int, repeats: int) -> dict:
    code = CodeEnv()
    examples, rollouts = rollouts_of(code, completions, lambda env, e: env.demonstration(e, random.Random(0)))
    n = len(rollouts)
    timed(code, examples, rollouts[:batch_size], None)  # the sandbox's first start
    runs = [setting("in process", 0, [timed(code, examples, rollouts, None) for _ in range(repeats)], n)]
    trivial = ArithmeticEnv()
    one = rollouts_of(trivial, 1, lambda env, e: "0")
    for workers in WORKERS:
        cluster = open_cluster(ClusterConfig(runner="dask", workers=workers, batch_size=batch_size))
        try:
            timed(code, examples, rollouts[:batch_size * workers], cluster)  # warm every worker
            times = [timed(code, examples, rollouts, cluster) for _ in range(repeats)]
            overhead = min(timed(trivial, *one, cluster) for _ in range(5))
        finally:
            cluster.close()
        runs.append(setting(f"dask, {workers} worker{'s' if workers > 1 else ''}", workers, times, n, overhead))
    for run in runs:
        run["vs_in_process"] = run["completions_per_second"] / runs[0]["completions_per_second"]
    return {"machine": {"platform": machine_platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
            "settings": {"completions": n, "batch_size": batch_size, "repeats": repeats,
                         "tests_per_completion": statistics.mean(len(examples[r.example_id].answer) for r in rollouts)},
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/cluster_scoring.json")
    args = parser.parse_args()
    with api_for_a_script():  # the Prefect API the workers report to
        results = bench(args.completions, args.batch_size, args.repeats)
    write_results(args.out, results)
    for run in results["runs"]:
        print(f"{run['setting']}: {run['completions_per_second']:.1f} completions/s ({run['vs_in_process']:.2f}×)"
              + (f", {run['batch_overhead_ms']:.0f} ms per batch" if run["batch_overhead_ms"] is not None else ""))


if __name__ == "__main__":
    main()
