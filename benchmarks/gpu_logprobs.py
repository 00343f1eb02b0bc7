"""`bench_gpu --parts logprobs`: the chunked selective log-softmax alone on the GPU, previous
version vs now.

The H100 profile put 25% of a Qwen3-0.6B train step in it (docs/BENCHMARKS_GPU.md). Here hidden
states [T, 1024] and an LM head [151,936, 1024] (fp32 master weights, bf16 autocast, as the train
step runs it, then pure bf16), T = one train step's tokens, chunks of 1,024 tokens:
- old:      benchmarks/logprobs_baseline.py (fp32 [C, V] copies, ~5 passes forward, ~8 backward);
- eager:    training.logprobs with kernels="eager" (saved logsumexp, in-place passes);
- compiled: kernels="compiled", what "auto" runs on CUDA with train.compile (first call, compile
  included, apart).
Reported: forward (no_grad) and forward + backward medians, peak memory above the inputs, the
compiled graphs' count after warm-up and after the timed calls (equal: no recompiles), and the
largest log-prob difference to the old version.
"""

from __future__ import annotations

import statistics

import torch
from rlpipe.training.logprobs import selective_log_softmax

from benchmarks.logprobs_baseline import old_selective_log_softmax
from benchmarks.timing import timed

VOCAB, HIDDEN, CHUNK = 151_936, 1024, 1024


def bench_logprobs_gpu(tokens: int, repeats: int, device: str = "cuda", vocab: int = VOCAB,
                       hidden: int = HIDDEN) -> list[dict]:
    """One row per (precision, method): fwd and fwd+bwd seconds, peak extra GiB (CUDA only),
    compiled graphs. device/vocab/hidden other than the defaults: a smoke run on the CPU."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for precision, dtype in (("bf16 autocast, fp32 weights", torch.float32), ("pure bf16", torch.bfloat16)):
        h = (torch.randn(tokens, hidden, device=device, generator=gen) / hidden**0.25).to(dtype).requires_grad_()
        w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.25).to(dtype).requires_grad_()
        labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        labels[::50] = -100
        rows += _rows(h, w, labels, precision, repeats)
        del h, w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _rows(h, w, labels, precision: str, repeats: int) -> list[dict]:
    from torch._dynamo.utils import counters

    device, rows, reference = h.device, [], None
    cuda = device.type == "cuda"
    for method in ("old", "eager", "compiled"):
        def forward(method=method):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                if method == "old":
                    return old_selective_log_softmax(h, w, labels, CHUNK)
                return selective_log_softmax(h, w, labels, CHUNK, kernels=method)

        def train(forward=forward):
            forward().sum().backward()
            h.grad = w.grad = None

        first = timed(train, 1, warmup=0, device=device)[0]  # the compiled kernels compile here
        train()
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            out = forward()
            fwd = statistics.median(timed(forward, repeats, warmup=0, device=device))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        both = statistics.median(timed(train, repeats, warmup=0, device=device))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
        reference = out if reference is None else reference
        rows.append({"precision": precision, "method": method, "tokens": h.shape[0], "vocab": w.shape[0],
                     "hidden": h.shape[1], "chunk": CHUNK, "fwd_seconds": fwd, "fwd_bwd_seconds": both,
                     "first_call_seconds": first, "peak_extra_gib": peak,
                     "graphs_after_warmup": graphs, "graphs_after_timing": counters["stats"]["unique_graphs"],
                     "max_abs_diff_vs_old": float((out - reference).abs().max())})
    return rows


def render_logprobs(rows: list[dict]) -> list[str]:
    """The Markdown section of docs/BENCHMARKS_GPU.md."""
    r0 = rows[0]
    lines = [f"## Chunked selective log-softmax alone (T={r0['tokens']:,}, H={r0['hidden']}, V={r0['vocab']:,}, "
             f"chunks of {r0['chunk']:,})", "",
             "old = before the saved logsumexp; eager / compiled = `kernels=` of training/logprobs.py "
             "(`auto` compiles on CUDA with train.compile). first call = compile included for compiled.", "",
             "| precision | method | fwd s | fwd+bwd s | old/this fwd+bwd | first call s | peak extra GiB | "
             "graphs (warm / after) | max abs diff vs old |", "|---|---|---|---|---|---|---|---|---|"]
    old = {r["precision"]: r["fwd_bwd_seconds"] for r in rows if r["method"] == "old"}
    for r in rows:
        lines.append(f"| {r['precision']} | {r['method']} | {r['fwd_seconds']:.4f} | {r['fwd_bwd_seconds']:.4f} | "
                     f"{old[r['precision']] / r['fwd_bwd_seconds']:.2f}x | {r['first_call_seconds']:.2f} | "
                     f"{r['peak_extra_gib'] or 0:.2f} | {r['graphs_after_warmup']} / {r['graphs_after_timing']} | "
                     f"{r['max_abs_diff_vs_old']:.2e} |")
    return lines + [""]
