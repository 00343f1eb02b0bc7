"""Rollout tokens/s through `rlpipe serve` (1 and 2 local servers) vs the in-process engine,
and weight-sync latency (POST /update_weights_from_disk round trip).

Same checkpoint (a preset built with a fixed seed and saved to a temporary run folder), same
prompts (64 by default, lengths 16-32 of the character vocabulary), same sampling (temperature
1.0, no stop tokens, so every sequence runs --new-tokens). Scenarios:

- `in_process`:  TorchEngine.generate on the loaded checkpoint, all prompts in one call;
- `1_server`:    one `rlpipe serve` process, all prompts in one HTTP request;
- `2_servers`:   two processes, half of the prompts each, requested in parallel, each with
                 max(1, threads // 2) torch threads: with the default --threads 1 that is one
                 thread EACH, two in all, against one in-process, so this row also has twice the
                 cores (`threads_total` in the JSON says how many each scenario used);
- `1_server_concurrent`: one server, every prompt its own request (16 client threads, no seed):
                 the server's batcher merges them into few engine calls.

Sync latency: the median over --syncs round trips of /update_weights_from_disk, alternating two
checkpoints (load, sha256 check, swap). Runs are repeated --repeats times; medians are shown,
and the best run too (on a loaded machine the least disturbed run is the better estimate).
CPU timings swing with whatever else runs on the machine: the load average is recorded with
the results. Servers bind 127.0.0.1 and are always killed at the end.

Threads default to 1: on a CPU with 2 cores under load (load average ~9), two torch threads
in the main thread ran the same decode 10-80x slower (3-35 s instead of 0.4 s), an OpenMP
oversubscription effect that would swamp what this benchmark measures.

    python -m benchmarks.bench_serve [--preset tiny-dense] [--prompts 64] [--new-tokens 64]
        [--repeats 3] [--syncs 5] [--threads N] [--out runs/bench/serve.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.http import HttpEngine, HttpOptions
from rlpipe.engines.serve_process import serve_url, start_serve, stop_processes
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.presets import build_model, count_parameters
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint

from benchmarks.results import machine_platform, write_results


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 16-32 ordinary (non-special) tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 33, (count,), generator=g).tolist()
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def count_tokens(groups) -> int:
    return sum(len(c.tokens) for group in groups for c in group)


def spread(engines: list[HttpEngine], prompts: list[list[int]], params: SamplingParams) -> int:
    share = -(-len(prompts) // len(engines))
    chunks = [prompts[i : i + share] for i in range(0, len(prompts), share)]
    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        parts = list(pool.map(lambda pair: pair[0].generate(pair[1], params),
                              zip(engines, chunks, strict=False)))
    return sum(count_tokens(p) for p in parts)


def concurrent_singles(engine: HttpEngine, prompts: list[list[int]], new_tokens: int) -> int:
    params = SamplingParams(max_new_tokens=new_tokens)  # no seed: the server may merge them
    with ThreadPoolExecutor(max_workers=16) as pool:
        parts = list(pool.map(lambda p: engine.generate([p], params), prompts))
    return sum(count_tokens(p) for p in parts)


def run(args: argparse.Namespace) -> dict:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cores = torch.get_num_threads()
    tok = build_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="rlpipe-bench-serve-"))
    model = build_model(args.preset, vocab_size=len(tok), seed=0)
    first = save_checkpoint(tmp, 0, model, tok)
    second = save_checkpoint(tmp, 1, build_model(args.preset, vocab_size=len(tok), seed=1), tok)
    prompts = make_prompts(args.prompts, len(tok))
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    local = TorchEngine(load_checkpoint(first, restore_rng=False).model.eval())

    procs: list[subprocess.Popen] = []
    times: dict[str, list[float]] = {k: [] for k in ("in_process", "1_server", "2_servers",
                                                     "1_server_concurrent")}
    tokens: dict[str, int] = {}
    sync_s: list[float] = []
    try:
        procs.append(start_serve(first, threads=cores))
        procs += [start_serve(first, threads=max(1, cores // 2)) for _ in range(2)]
        one, *two = [HttpEngine(serve_url(p), HttpOptions(timeout_s=600, retries=0)) for p in procs]
        warm = SamplingParams(max_new_tokens=4, seed=0)
        for engine in [one, *two]:
            engine.generate(prompts[:2], warm)
        local.generate(prompts[:2], warm)
        runs = {
            "in_process": lambda: count_tokens(local.generate(prompts, params)),
            "1_server": lambda: count_tokens(one.generate(prompts, params)),
            "2_servers": lambda: spread(two, prompts, params),
            "1_server_concurrent": lambda: concurrent_singles(one, prompts, args.new_tokens),
        }
        for _ in range(args.repeats):
            for name, fn in runs.items():  # interleaved: background load hits every scenario
                seconds, n = timed(fn)
                times[name].append(seconds)
                tokens[name] = n
        for i in range(args.syncs):
            target, version = (second, 1) if i % 2 == 0 else (first, 0)
            start = time.perf_counter()
            one.sync(str(target), version)
            sync_s.append(time.perf_counter() - start)
        checkpoint_bytes = sum(f.stat().st_size for f in first.iterdir() if f.is_file())
    finally:
        stop_processes(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    results = {
        name: {
            "seconds_median": statistics.median(ts),
            "seconds_all": ts,
            "tokens": tokens[name],
            "tokens_per_s": tokens[name] / statistics.median(ts),
            "tokens_per_s_best": tokens[name] / min(ts),  # least disturbed run on a shared CPU
        }
        for name, ts in times.items()
    }
    base = results["in_process"]["tokens_per_s"]
    two = max(1, cores // 2)
    threads_total = {"in_process": cores, "1_server": cores, "2_servers": 2 * two, "1_server_concurrent": cores}
    for name, r in results.items():
        r["vs_in_process"] = r["tokens_per_s"] / base
        r["threads_total"] = threads_total[name]
    return {
        "benchmark": "serve",
        "preset": args.preset,
        "parameters": count_parameters(model),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch_threads": cores,
        "results": results,
        "sync_latency_s": {"median": statistics.median(sync_s), "all": sync_s},
        "checkpoint_bytes": checkpoint_bytes,
        "machine": {"platform": machine_platform(), "cpus": os.cpu_count(),
                    "loadavg": os.getloadavg(), "torch": torch.__version__},
    }


def print_table(report: dict) -> None:
    print(f"rlpipe serve — {report['preset']} ({report['parameters']:,} params), "
          f"{report['prompts']} prompts x {report['new_tokens']} new tokens, "
          f"median of {report['repeats']}")
    print(f"{'scenario':<22}{'seconds':>10}{'tokens/s':>12}{'best tok/s':>12}{'vs in-process':>15}")
    for name, r in report["results"].items():
        print(f"{name:<22}{r['seconds_median']:>10.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['tokens_per_s_best']:>12.0f}{r['vs_in_process']:>15.2f}")
    print(f"sync (update_weights_from_disk) round trip: median "
          f"{report['sync_latency_s']['median'] * 1000:.0f} ms over {len(report['sync_latency_s']['all'])}")
    print(f"load average: {report['machine']['loadavg']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-dense")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in-process and for the 1-server run (0 = torch's "
                             "default); each of the 2 servers gets half, at least 1")
    parser.add_argument("--out", default="runs/bench/serve.json")
    args = parser.parse_args(argv)
    report = run(args)
    out = write_results(args.out, report)
    print_table(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
