"""Peak memory and time of chunked selective log-softmax vs full log_softmax + gather, and of
the current chunked version vs the previous one.

Per-token log-probs of T labels under a vocabulary of V (Qwen3's 151,936) from hidden states
[T, H] and an LM head [V, H]:

- full:     log_softmax(h · Wᵀ).gather(labels) — builds [T, V] logits and log-probs;
- chunked:  training.logprobs.selective_log_softmax (chunks of --chunk tokens, recomputing
            backward; kernels="eager", what "auto" runs on the CPU) — never a [T, V] tensor;
- compiled: the same with kernels="compiled" (what "auto" runs on CUDA); the compile happens in
            the warm-up and is reported apart (compile_s);
- old:      the version before the saved logsumexp and the fused kernels
            (benchmarks/logprobs_baseline.py).

The `train` rows (forward + backward into h and W) of old / chunked / compiled run at
--train-tokens in float32, and at --bf16-tokens under bf16 autocast with --dtypes float32,bfloat16
(the GPU comparison in bf16 is `bench_gpu --parts logprobs`).

Each variant runs in a fresh subprocess, so the peak resident set (getrusage ru_maxrss) is that
variant's alone; the figure reported is the peak minus the resident set once the inputs exist.
`fwd` runs under no_grad; `train` runs forward + backward into h and W. The full variant's train
case defaults to a shorter T (it needs ~4 [T, V] float32 tensors: ~20 GB at T=8192).

    python -m benchmarks.bench_logprobs [--tokens 8192] [--vocab 151936] [--hidden 256]
        [--chunk 1024] [--full-train-tokens 2048] [--train-tokens 4096] [--dtypes float32[,bfloat16]]
        [--bf16-tokens 1024]
        [--repeats 2] [--out runs/bench/bench_logprobs.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.results import machine_platform, write_results

MiB = 1024 * 1024


def _rss_peak_bytes() -> int:
    # ru_maxrss is KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return _rss_peak_bytes()


def run_child(method: str, mode: str, tokens: int, vocab: int, hidden: int, chunk: int, repeats: int,
              dtype: str = "float32") -> dict:
    """Measure one variant in this (fresh) process; returns a result dict."""
    import torch
    from rlpipe.training.logprobs import selective_log_softmax

    from benchmarks.logprobs_baseline import old_selective_log_softmax

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden) / hidden**0.25
    w = torch.randn(vocab, hidden) / hidden**0.25
    labels = torch.randint(0, vocab, (tokens,))
    train = mode == "train"
    h.requires_grad_(train)
    w.requires_grad_(train)

    def forward(hn, ln):
        if method == "full":
            return torch.log_softmax((hn @ w.t()).float(), dim=-1).gather(1, ln[:, None]).squeeze(1)
        if method == "old":
            return old_selective_log_softmax(hn, w, ln, chunk_size=chunk)
        return selective_log_softmax(hn, w, ln, chunk_size=chunk,
                                     kernels="compiled" if method == "compiled" else "eager")

    def once(n: int) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = forward(h[:n], labels[:n])
        if train:
            out.sum().backward()
            h.grad = w.grad = None
        return float(out.detach().sum())

    # Warm up on 4 tokens so library initialisation (oneDNN, autograd, the compile) is not counted.
    t0 = time.perf_counter()
    with torch.set_grad_enabled(train):
        once(4)
    warmup_s = time.perf_counter() - t0
    base_rss = _current_rss_bytes()
    base_peak = _rss_peak_bytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            once(tokens)
        times.append(time.perf_counter() - t0)
    peak = _rss_peak_bytes()
    return {
        "method": method,
        "mode": mode,
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden,
        "dtype": dtype,
        "chunk": None if method == "full" else chunk,
        "compile_s": round(warmup_s, 1) if method == "compiled" else None,
        "peak_extra_mib": round((peak - max(base_rss, 0)) / MiB, 1),
        "peak_rss_mib": round(peak / MiB, 1),
        "rss_before_mib": round(base_rss / MiB, 1),
        "peak_before_mib": round(base_peak / MiB, 1),
        "seconds_median": round(statistics.median(times), 3),
        "seconds": [round(t, 3) for t in times],
        "torch_threads": torch.get_num_threads(),
    }


def _spawn(args: argparse.Namespace, method: str, mode: str, tokens: int, dtype: str) -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.bench_logprobs", "--child",
        "--method", method, "--mode", mode, "--tokens", str(tokens), "--vocab", str(args.vocab),
        "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--repeats", str(args.repeats),
        "--dtype", dtype,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"method": method, "mode": mode, "tokens": tokens, "dtype": dtype,
                "error": proc.stderr.strip()[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--full-train-tokens", type=int, default=2048,
                        help="T for the full variant's forward+backward (memory-hungry)")
    parser.add_argument("--train-tokens", type=int, default=4096,
                        help="T for the old / chunked / compiled forward+backward comparison")
    parser.add_argument("--bf16-tokens", type=int, default=1024, help="T of the bfloat16 rows")
    parser.add_argument("--dtypes", default="float32",
                        help="comma-separated: float32 and/or bfloat16 (CPU autocast) for that comparison; "
                        "bfloat16 only where the CPU has fast bf16 GEMMs (AVX512-BF16/AMX): without, they are "
                        "emulated, and one old fwd+bwd at T=1,024 ran > 4 min on a CPU with 2 cores")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/bench/bench_logprobs.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=["full", "chunked", "compiled", "old"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["fwd", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = run_child(args.method, args.mode, args.tokens, args.vocab, args.hidden, args.chunk, args.repeats,
                           args.dtype)
        print(json.dumps(result))
        return

    plan = [
        ("full", "fwd", args.tokens, "float32"),
        ("chunked", "fwd", args.tokens, "float32"),
        ("full", "train", args.full_train_tokens, "float32"),
        ("chunked", "train", args.full_train_tokens, "float32"),
    ]
    for dtype in [d for d in args.dtypes.split(",") if d]:
        tokens = args.train_tokens if dtype == "float32" else args.bf16_tokens
        plan += [(method, "train", tokens, dtype) for method in ("old", "chunked", "compiled")]
    seen, results = set(), []
    for key in plan:
        if key not in seen:
            seen.add(key)
            results.append(_spawn(args, *key))

    report = {
        "benchmark": "bench_logprobs",
        "machine": {"platform": machine_platform(), "python": platform.python_version()},
        "note": "peak_extra_mib = peak RSS (getrusage) minus RSS once inputs exist, fresh process per row",
        "results": results,
    }
    out = write_results(args.out, report)

    print(f"{'method':8} {'mode':5} {'dtype':8} {'T':>6} {'peak extra MiB':>15} {'seconds':>8}")
    for r in results:
        head = f"{r['method']:8} {r['mode']:5} {r['dtype']:8} {r['tokens']:>6}"
        if "error" in r:
            print(f"{head} error: {r['error'].splitlines()[-1]}")
        else:
            print(f"{head} {r['peak_extra_mib']:>15.1f} {r['seconds_median']:>8.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
