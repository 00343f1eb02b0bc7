"""`train.compile` on the CPU: eager vs compiled decoder layers, train-step tokens/s and compile time.

The same RL-like packed micro-batches (sequences of 32-256 tokens, seeded) are trained one optimizer
step at a time (`training.step.forward_backward` + `optim_step`, the run's own step) by two copies
of one model, eager and with `models.compile.compile_layers`; steps alternate eager/compiled so both
see the same machine load, and the median real tokens/s over the repeats is reported, in fp32 and,
where the CPU supports it, under bf16 autocast. The compiled model's first step is timed apart
(`warmup_seconds`: dynamo + inductor compiling, from an empty inductor cache) and dynamo's frame
count after it must not grow (`recompiles_after_warmup`), though micro-batch lengths vary.

The point of `train.compile` is the GPU (bench_gpu's train part); this records what it does on a
CPU, honestly, which is why the key defaults to off.

    python -m benchmarks.bench_compile [--preset small-dense] [--repeats 5] [--threads 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from rlpipe.models.compile import compile_layers
from rlpipe.models.loading import bf16_autocast_supported
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

from benchmarks.results import write_results

VOCAB = 100


def step_batches(step: int, n: int, budget: int) -> list:
    """Step `step`'s micro-batches: `n` sequences of 32-256 tokens (lengths differ every step)."""
    g = torch.Generator().manual_seed(step)
    seqs = []
    for i in range(n):
        length = int(torch.randint(32, 257, (1,), generator=g))
        tokens = torch.randint(4, VOCAB, (length,), generator=g).tolist()
        seqs.append(Sequence(tokens=tokens, weights=[0.0] * 8 + [1.0] * (length - 8), sample_id=f"s{i}"))
    return pack(seqs, token_budget=budget)


def timed_step(model, optimizer, batches, autocast: bool) -> float:
    start = time.perf_counter()
    forward_backward(model, batches, nll_loss, StepOptions(autocast=autocast))
    optim_step(model, optimizer, None, max_grad_norm=1.0)
    return time.perf_counter() - start


def compare(preset: str, autocast: bool, repeats: int, n: int, budget: int) -> dict:
    """Eager vs compiled copies of one model, stepping in turn on the same batches."""
    from torch._dynamo.utils import counters

    eager = build_model(preset, vocab_size=VOCAB, seed=0)
    compiled = compile_layers(copy.deepcopy(eager))
    models = {"eager": eager, "compiled": compiled}
    optimizers = {k: build_optimizer(m, lr=1e-4) for k, m in models.items()}
    first = step_batches(0, n, budget)
    warm = {k: timed_step(m, optimizers[k], first, autocast) for k, m in models.items()}
    frames = int(counters["frames"]["ok"])
    seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
    tokens = []
    for step in range(1, repeats + 1):
        batches = step_batches(step, n, budget)
        tokens.append(sum(b.n_tokens for b in batches))
        for name, model in models.items():
            seconds[name].append(timed_step(model, optimizers[name], batches, autocast))
    rate = {k: statistics.median(t / s for t, s in zip(tokens, v, strict=True)) for k, v in seconds.items()}
    return {
        "preset": preset, "autocast": autocast, "tokens_per_step": statistics.median(tokens),
        "micro_batch_tokens": sorted({b.n_tokens for s in range(1, repeats + 1) for b in step_batches(s, n, budget)}),
        "eager_tokens_per_second": rate["eager"], "compiled_tokens_per_second": rate["compiled"],
        "compiled_over_eager": rate["compiled"] / rate["eager"],
        "eager_first_step_seconds": warm["eager"], "warmup_seconds": warm["compiled"],
        "recompiles_after_warmup": int(counters["frames"]["ok"]) - frames,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small-dense")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on shared cores, as the distributed benchmark)")
    parser.add_argument("--out", default="runs/bench/compile.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "results": []}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile, as on a fresh machine
        for autocast in (False, True):
            if autocast and not bf16_autocast_supported(torch.device("cpu")):
                report["results"].append({"autocast": True, "skipped": "no bf16 on this CPU"})
                continue
            report["results"].append(compare(args.preset, autocast, args.repeats, args.sequences, args.budget))
            print(json.dumps(report["results"][-1]), flush=True)
    report["repeats"], report["loadavg"] = args.repeats, os.getloadavg()
    write_results(args.out, report)
    return report


if __name__ == "__main__":
    main()
