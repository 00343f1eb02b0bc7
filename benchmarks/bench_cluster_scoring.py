"""Score-stage throughput of the code environment: in process vs a local Dask cluster of 1, 2
and 4 worker processes ([cluster] runner = "dask"), and the per-batch overhead (a batch of one
rollout of an environment whose reward costs nothing, timed end to end).

    python benchmarks/bench_cluster_scoring.py --completions 256 --batch-size 32

Needs the `cluster` extra and a Prefect API (PREFECT_API_URL) the workers can reach.
"""

from __future__ import annotations

import argparse
import time

from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.code import CodeEnv
from rlpipe.rollouts.records import Rollout
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.tasks.cluster import open_cluster
from rlpipe.tasks.cluster_config import ClusterConfig


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    code = CodeEnv()
    examples, rollouts = rollouts_of(code, args.completions, lambda env, e: env.demonstration(e, __import__("random").Random(0)))
    seconds = timed(code, examples, rollouts, None)
    print(f"| in process | {seconds:.2f} s | {len(rollouts) / seconds:.1f} completions/s | - |")
    trivial = ArithmeticEnv()
    one = rollouts_of(trivial, 1, lambda env, e: "0")
    for workers in (1, 2, 4):
        cluster = open_cluster(ClusterConfig(runner="dask", workers=workers, batch_size=args.batch_size))
        try:
            timed(code, *rollouts_of(code, workers, lambda env, e: "x"), cluster)  # warm every worker
            seconds = timed(code, examples, rollouts, cluster)
            overhead = min(timed(trivial, *one, cluster) for _ in range(5))
            print(f"| dask, {workers} worker(s) | {seconds:.2f} s | {len(rollouts) / seconds:.1f} completions/s "
                  f"| {overhead * 1000:.0f} ms |")
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
