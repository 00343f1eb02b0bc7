"""Data-parallel training throughput on the CPU: real tokens/s of 1 process vs 2 gloo ranks.

The same optimizer steps (each `--sequences` random sequences, lengths uniform in [32, 256],
seeded) are trained by:

- 1 process, 1 thread and 1 process, 2 threads (the single-process trainer: forward_backward +
  optim_step over micro-batches of at most `--budget` tokens);
- 2 ranks of 1 thread each, DDP and FSDP2, the way the flows run them: rank 0 packs the step
  (training.distributed.balanced_budget), `lead_step` broadcasts it, rank 1 `follow`s; each rank
  trains its token-balanced share, gradients are all-reduced (gloo).

Each setting runs in fresh processes; settings alternate per repeat so they see the same machine
load, and the median over repeats is reported. Real tokens/s = the step's tokens (no padding
exists in packed batches) / wall seconds on rank 0, first step (warm-up) excluded.

On a CPU with 2 cores, 2 ranks can at best match 1 process using both cores; what this measures is the overhead of the distributed path
(broadcast of the batch, gradient all-reduce, fillers), not a speed-up you would see with a GPU
per rank (NCCL).

    python -m benchmarks.bench_distributed [--preset small-dense] [--steps 3] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rlpipe.core.ports import free_port

from benchmarks.results import machine_platform, write_results

VOCAB = 100
SETTINGS = [("1 process, 1 thread", "none", 1, 1), ("1 process, 2 threads", "none", 1, 2),
            ("2 ranks DDP, 1 thread each", "ddp", 2, 1), ("2 ranks FSDP2, 1 thread each", "fsdp2", 2, 1)]


def step_sequences(steps: int, n: int, seed: int = 0):
    from rlpipe.training.batch import Sequence

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(32, 257, (n,), generator=g).tolist()
        out.append([Sequence(tokens=torch.randint(1, VOCAB, (k,), generator=g).tolist(), weights=[1.0] * k)
                    for k in lengths])
    return out


def _worker(rank: int, world: int, port: int, kind: str, threads: int, args: dict, out: str) -> None:
    import torch.distributed as dist
    from rlpipe.models.presets import build_model
    from rlpipe.training.batch import pack
    from rlpipe.training.dist_trainer import follow, lead_step, stop_followers
    from rlpipe.training.distributed import balanced_budget, data_parallel
    from rlpipe.training.losses import nll_loss
    from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step
    from rlpipe.training.trainer import TrainOptions

    torch.set_num_threads(threads)
    steps = step_sequences(args["steps"] + 1, args["sequences"])
    model = build_model(args["preset"], VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    if kind == "none":
        optimizer = build_optimizer(model, lr=1e-4)
        seconds = []
        for seqs in steps:
            start = time.perf_counter()
            forward_backward(model, pack(seqs, args["budget"]), nll_loss, StepOptions(normaliser="token"))
            optim_step(model, optimizer, None, 1.0)
            seconds.append(time.perf_counter() - start)
        Path(out).write_text(json.dumps(seconds))
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    dp = optimizer = None
    try:
        dp = data_parallel(model, kind, torch.device("cpu"))
        optimizer = build_optimizer(model, lr=1e-4)
        if rank > 0:
            follow(dp, optimizer, None, nll_loss)
            return
        seconds = []
        for seqs in steps:
            start = time.perf_counter()
            total, longest = sum(len(s.tokens) for s in seqs), max(len(s.tokens) for s in seqs)
            batches = pack(seqs, balanced_budget(total, longest, args["budget"], world))
            lead_step(dp, optimizer, None, batches, nll_loss,
                      TrainOptions(step=StepOptions(normaliser="token", entropy=False), max_grad_norm=1.0))
            seconds.append(time.perf_counter() - start)
        stop_followers(dp)
        Path(out).write_text(json.dumps(seconds))
    finally:
        # DDP's reducer must go before its process group: freed after it, its destructor joins
        # gloo's thread while holding the GIL that thread waits for (seen here: a hung rank 0)
        dp = optimizer = model = None
        gc.collect()
        dist.destroy_process_group()


def measure(kind: str, world: int, threads: int, args: dict) -> float:
    """Real tokens/s of one setting (fresh processes), warm-up step excluded."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "seconds.json")
        mp.spawn(_worker, args=(world, free_port(), kind, threads, args, out), nprocs=world, join=True)
        seconds = json.loads(Path(out).read_text())[1:]
    tokens = sum(len(s.tokens) for seqs in step_sequences(args["steps"] + 1, args["sequences"])[1:] for s in seqs)
    return tokens / sum(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-dense")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per setting")
    parser.add_argument("--sequences", type=int, default=24, help="sequences per step")
    parser.add_argument("--budget", type=int, default=1024, help="micro-batch token budget")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/distributed.json")
    args = parser.parse_args(argv)
    settings = vars(args) | {}
    rates: dict[str, list[float]] = {label: [] for label, *_ in SETTINGS}
    for repeat in range(args.repeats):
        for label, kind, world, threads in SETTINGS:
            rates[label].append(measure(kind, world, threads, settings))
            print(f"repeat {repeat}: {label}: {rates[label][-1]:,.0f} tok/s", flush=True)
    base = statistics.median(rates[SETTINGS[0][0]])
    results = {
        "machine": {"platform": machine_platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "loadavg": os.getloadavg()},
        "settings": {k: v for k, v in settings.items() if k != "out"},
        "tokens_per_step_mean": statistics.mean(
            sum(len(s.tokens) for s in seqs) for seqs in step_sequences(args.steps + 1, args.sequences)),
        "runs": [{"setting": label, "kind": kind, "ranks": world, "threads_per_rank": threads,
                  "tokens_per_second": statistics.median(rates[label]), "all": rates[label],
                  "vs_1_process_1_thread": statistics.median(rates[label]) / base}
                 for label, kind, world, threads in SETTINGS],
    }
    write_results(args.out, results)
    print(json.dumps(results["runs"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
