"""Generated tokens/s of the in-process TorchEngine vs transformers' `model.generate`.

Same model (the `small-dense` preset: Qwen3, hidden 256, 4 layers, 4 heads / 2 kv heads,
intermediate 768; vocabulary 128), same prompts (64 sequences, prompt lengths 16-48), same
sampling (temperature 1.0, no top-k / top-p), 128 new tokens. Scenarios:

- `no_stop`: no stop tokens, every sequence runs 128 tokens (equal work for both);
- `stop`:    a few stop tokens (~1/40 chance per step each sequence finishes); tokens/s counts
             only the tokens up to and including the stop token. TorchEngine drops finished
             sequences from the batch, generate keeps decoding them until all are done;
- `groups`:  8 prompts x n=8 samples (RL-style groups; the engine prefills each prompt once).

`static_decode` (also in the JSON): the engine's eager decode against the static decode step that
`engine.cuda_graphs` captures on CUDA (engines/static_decode.py), run here uncaptured on the CPU,
same batches and draws (`no_stop`, small-dense and small-moe). It is the CPU cost of fixed shapes
(attention over whole 256-column spans, every MoE expert on every token), not a graph speed-up.

Runs alternate engine / generate (so load from other processes hits both), `--repeats` times;
the table shows medians. ms per decode step = (time for 128 tokens - time for 1 token) / 127.
CPU timings swing with the machine's load: the load average is recorded with the results.

    python -m benchmarks.bench_engine [--repeats 3] [--batch 64] [--new-tokens 128]
        [--bf16] [--threads N] [--out runs/bench/engine.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.presets import build_model, count_parameters

from benchmarks.results import machine_platform, write_results

VOCAB = 128
STOP_TOKENS = (5, 17, 99)


def make_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (batch,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def engine_run(engine: TorchEngine, prompts, n: int, new_tokens: int, stop, seed: int) -> int:
    """One engine call; returns the number of generated tokens."""
    params = SamplingParams(
        n=n, temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=stop, seed=seed
    )
    out = engine.generate(prompts, params)
    return sum(len(c.tokens) for group in out for c in group)


def hf_run(model, prompts, n: int, new_tokens: int, stop, seed: int) -> int:
    """One `model.generate` call on the left-padded batch; returns real generated tokens
    (up to and including the first stop token of each row)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        num_return_sequences=n,
        pad_token_id=0,
        use_cache=True,
    )
    if stop:
        kwargs.update(eos_token_id=list(stop))
    else:
        kwargs.update(eos_token_id=None, min_new_tokens=new_tokens)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kwargs)[:, width:]
    if not stop:
        return out.numel()
    is_stop = torch.isin(out, torch.tensor(stop))
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, out.shape[1])
    return int(first.sum())


def timed(fn: Callable[..., int], *args) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn(*args)
    return time.perf_counter() - start, tokens


def run(args: argparse.Namespace) -> dict:
    engine_model = build_model("small-dense", vocab_size=VOCAB).eval()
    hf_model = build_model("small-dense", vocab_size=VOCAB).eval()
    # generate runs transformers' own sdpa path (the preset's packed attention falls back to
    # it anyway when no cu_seqlens are given)
    hf_model.config._attn_implementation = "sdpa"
    hf_model.config.use_cache = True
    engines: dict[str, Callable[..., int]] = {
        "torch_engine": lambda *a: engine_run(TorchEngine(engine_model, max_batch_size=256), *a),
        "hf_generate": lambda *a: hf_run(hf_model, *a),
    }
    if args.bf16:
        engines["torch_engine_bf16"] = lambda *a: engine_run(
            TorchEngine(engine_model, dtype=torch.bfloat16, max_batch_size=256), *a
        )
    prompts = make_prompts(args.batch)
    groups = make_prompts(args.batch // 8, seed=1)
    scenarios = {
        "no_stop": (prompts, 1, ()),
        "stop": (prompts, 1, STOP_TOKENS),
        "groups": (groups, 8, ()),
    }
    for fn in engines.values():  # warm-up (allocator, first-call paths)
        fn(prompts[:8], 1, 8, (), 0)
    results = []
    for scenario, (ps, n, stop) in scenarios.items():
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for rep in range(args.repeats):
            for name, fn in engines.items():
                seconds, tokens = timed(fn, ps, n, args.new_tokens, stop, rep)
                first = timed(fn, ps, n, 1, (), rep)[0] if not stop else None
                runs[name].append({"seconds": seconds, "tokens": tokens, "seconds_1_token": first})
        for name, rs in runs.items():
            tok_s = statistics.median(r["tokens"] / r["seconds"] for r in rs)
            step_ms = None
            if not stop:
                step_ms = statistics.median(
                    (r["seconds"] - r["seconds_1_token"]) / (args.new_tokens - 1) * 1e3 for r in rs
                )
            results.append(
                {
                    "scenario": scenario,
                    "engine": name,
                    "sequences": len(ps) * n,
                    "tokens_median": statistics.median(r["tokens"] for r in rs),
                    "tokens_per_s": tok_s,
                    "ms_per_decode_step": step_ms,
                    "runs": rs,
                }
            )
    speedups = {}
    for scenario in scenarios:
        by = {r["engine"]: r["tokens_per_s"] for r in results if r["scenario"] == scenario}
        speedups[scenario] = by["torch_engine"] / by["hf_generate"]
    return {
        "benchmark": "engine",
        "model": {
            "preset": "small-dense",
            "vocab": VOCAB,
            "parameters": count_parameters(engine_model),
        },
        "settings": {
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "temperature": 1.0,
            "stop_tokens": list(STOP_TOKENS),
        },
        "machine": {
            "platform": machine_platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_average_end": os.getloadavg(),
        },
        "results": results,
        "speedup_vs_generate": speedups,
        "static_decode": static_vs_eager(prompts, args.new_tokens, args.repeats),
    }


def static_vs_eager(prompts, new_tokens: int, repeats: int) -> list[dict]:
    """Decode tokens/s of the eager and the static (uncaptured) decode, same draws, alternating."""
    from rlpipe.engines import qwen3_fast
    from rlpipe.engines.decode_graphs import DecodeGraphs, GraphBackend
    from rlpipe.engines.decode_loop import generate_batch
    from rlpipe.engines.torch_engine import FastBackend

    prompts = sorted(prompts, key=len, reverse=True)  # as the engine orders them
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    rows = []
    for preset in ("small-dense", "small-moe"):
        model = build_model(preset, vocab_size=VOCAB).eval()
        graphs = DecodeGraphs(len(prompts), capture=False)
        seconds: dict[str, list[float]] = {"eager": [], "static": []}
        with torch.inference_mode():
            for rep in range(repeats + 1):  # the first round warms up
                for path in seconds:
                    weights = qwen3_fast.QwenWeights.from_model(model)
                    if path == "static":
                        graphs.bind(weights)
                    backend = GraphBackend(graphs) if path == "static" else FastBackend(weights)
                    start = time.perf_counter()
                    generate_batch(backend, prompts, params, torch.Generator().manual_seed(rep), torch.device("cpu"))
                    if rep:
                        seconds[path].append(time.perf_counter() - start)
        tokens = len(prompts) * new_tokens
        eager, static = (tokens / statistics.median(seconds[p]) for p in ("eager", "static"))
        rows.append({"preset": preset, "sequences": len(prompts), "new_tokens": new_tokens,
                     "eager_tokens_per_s": eager, "static_tokens_per_s": static, "static_over_eager": static / eager,
                     "seconds": seconds})
    return rows


def print_table(report: dict) -> None:
    print(f"{'scenario':<9} {'engine':<18} {'seqs':>5} {'tokens':>7} {'tok/s':>8} {'ms/step':>8}")
    for r in report["results"]:
        step = f"{r['ms_per_decode_step']:.1f}" if r["ms_per_decode_step"] is not None else "-"
        print(
            f"{r['scenario']:<9} {r['engine']:<18} {r['sequences']:>5} {r['tokens_median']:>7.0f} "
            f"{r['tokens_per_s']:>8.0f} {step:>8}"
        )
    print(
        "speedup vs generate:", {k: round(v, 2) for k, v in report["speedup_vs_generate"].items()}
    )
    for r in report["static_decode"]:
        print(f"static decode (uncaptured) / eager, {r['preset']}: {r['static_over_eager']:.2f}x "
              f"({r['static_tokens_per_s']:.0f} vs {r['eager_tokens_per_s']:.0f} tok/s)")
    print("load average at end:", report["machine"]["load_average_end"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="also time the engine in bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="runs/bench/engine.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    out = write_results(args.out, report)
    print_table(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
