"""`make bench`: run every benchmark side by side, then generate docs/BENCHMARKS.md from the JSON.

Each benchmark is a module `benchmarks.bench_<name>` that accepts `--out FILE` and writes its
raw results as JSON; this script adds the machine's matrix-multiply ceiling, collects everything
into `runs/bench/all.json` and renders one Markdown table per benchmark. The document is
generated: edit the benchmarks, not the document.

Above the raw key/values, each benchmark gets a headline table (benchmarks/headlines.py) with
the ratio to its anchor (packed/padded, chunked/full memory, engine/generate, rlpipe/TRL step
time, ...), and a summary table opens the document.

    python -m benchmarks.run_all [--only engine,packing] [--quick] [--render]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.learning_headlines import headline
from benchmarks.markdown_tables import fmt, table
from benchmarks.results import machine_platform, write_atomic, write_results

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = {
    "packing": "Training throughput: packed (varlen attention) vs padded, dense and MoE",
    "logprobs": "Log-probs: chunked selective log-softmax, memory vs full log_softmax, time vs the previous version (V=151,936)",
    "engine": "Engine: TorchEngine generated tokens/s vs transformers generate",
    "serve": "HTTP engines: rollout tokens/s with 1 and 2 `rlpipe serve` servers vs in-process; sync latency",
    "storage": "Storage: 1M rollout rows over 500 steps and 200,000 over 10,000 (compacted); write time, size, canned query time",
    "rl_step": "RL step by stage: the share outside the stage functions (Prefect, Parquet, MLflow)",
    "trl": "rlpipe vs TRL GRPOTrainer: seconds per optimizer step and reward, same model and task",
    "losses": "RL losses: does each `rl.loss.type` learn? Reward gain per loss on one task",
    "async": "Async RL: demo task with rl.off_policy.max_steps = 0, 1, 2, in-process and `rlpipe serve` engines",
    "distributed": "Data parallelism on the CPU: real tokens/s of 1 process vs 2 gloo ranks (DDP, FSDP2)",
    "compile": "train.compile on the CPU: eager vs compiled decoder layers, train-step tokens/s and compile time",
    "curriculum": "Curriculum: the demo's RL phase with rl.curriculum.type = none and pass_rate, same SFT start and seeds",
    "bytes": "Bytes per token: rollouts, train_tokens and checkpoints per generated and trained token, vs JSONL",
    "cluster_scoring": "Score stage on a cluster: code-task completions/s in process vs a local Dask cluster of 1, 2, 4 workers",
    "multiturn": "Multi-turn tool use: configs/multiturn.toml's calculator agent, held-out accuracy after SFT and RL, 3 seeds",
    "distill": "On-policy distillation vs RL on the demo: completions sampled to 95% held-out, same SFT start, 3 seeds",
    "code": "Sandboxed code RL: configs/code.toml's held-out pass-rate gain of RL over SFT, 3 seeds (target +10 points)",
}
# `--quick`: smaller versions of the slow ones (the document says the run was quick)
QUICK_ARGS = {
    "packing": ["--repeats", "3"],
    "logprobs": ["--repeats", "1"],
    "engine": ["--repeats", "1"],
    "serve": ["--repeats", "1"],
    "storage": ["--rows", "100000", "--long-steps", "2000", "--long-rows", "40000"],
    "rl_step": ["--steps", "10"],
    "trl": ["--steps", "10", "--seeds", "3", "--eval-samples", "2"],
    "losses": ["--steps", "30", "--seeds", "1"],
    "async": ["--rl-steps", "10", "--sft-steps", "100"],
    "distributed": ["--repeats", "1", "--steps", "2"],
    "compile": ["--repeats", "2"],
    "curriculum": ["--sft-steps", "300", "--rl-steps", "30"],
    "bytes": ["--steps", "1"],
    "cluster_scoring": ["--completions", "64", "--repeats", "1"],
    "multiturn": ["--seeds", "0", "--sft-steps", "100", "--rl-steps", "10"],
    "distill": ["--seeds", "0", "--sft-steps", "300", "--rl-steps", "30", "--eval-examples", "200"],
    "code": ["--seeds", "0", "--sft-steps", "100", "--rl-steps", "10"],
}


def matmul_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """This machine's dense matmul rate (the MFU denominator), median of `repeats`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        times.append((time.perf_counter() - start) / 4)
    return 2 * n**3 / statistics.median(times) / 1e9


def machine() -> dict:
    return {"platform": machine_platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def run_benchmark(name: str, out: Path, quick: bool) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.bench_{name}", "--out", str(out)]
    if quick:
        cmd += QUICK_ARGS.get(name, [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stderr or proc.stdout)[-2000:], "seconds": seconds}
    return {"results": json.loads(out.read_text()), "seconds": seconds}


def flatten(data, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(data, dict):
        return [item for key, value in data.items() for item in flatten(value, f"{prefix}{key}.")]
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        return [item for i, value in enumerate(data) for item in flatten(value, f"{prefix}{i}.")]
    if isinstance(data, list):
        return [(prefix.rstrip("."), data if len(data) <= 6 else f"[{len(data)} values]")]
    return [(prefix.rstrip("."), data)]


# how to measure the GPU figures (docs/BENCHMARKS_GPU.md): kept in the generated document
ON_A_GPU = [
    '## On a CUDA machine',
    '',
    'The GPU figures (one NVIDIA GPU, which its tables name: train step MFU, engine, rlpipe vs TRL, `configs/gpu.toml`) are in [BENCHMARKS_GPU.md](BENCHMARKS_GPU.md), written by `benchmarks/bench_gpu.py`; `make bench` on a machine without CUDA leaves them as they are. To measure them, from the repository root of a checkout on a machine with one NVIDIA GPU:',
    '',
    '    python -m pip install --no-deps --no-build-isolation -e .      # beside torch, transformers, vLLM, TRL',
    '    python -m benchmarks.bench_gpu --quick                            # every GPU figure in one table, ~6 min',
    '    python -m pytest -m gpu                                           # tests/gpu: the CUDA paths, ~1 min',
    '    python -m benchmarks.bench_gpu --out runs/bench/gpu.json          # parts train engine rl_vs_trl logprobs',
    '    python -m benchmarks.bench_gpu --parts rl_vs_trl_vllm             # both sides on vLLM, colocated',
    '    cp runs/bench/gpu.json docs/BENCHMARKS_GPU.json && python -m benchmarks.bench_gpu --render docs/BENCHMARKS_GPU.json',
    '',
    'Both need only torch, transformers, vLLM and TRL in the GPU machine\'s Python (plus what a CUDA image carries: numpy, safetensors, tokenizers, pyarrow, peft, pytest); Prefect, MLflow, DuckDB, Polars and pydantic are never imported on that path (tests/unit/test_gpu_checks_path.py checks it with them blocked). Add `liger-kernel` for `train.fused = "liger"` (its test in tests/gpu skips, saying so, without it). Where FlashInfer is not installed the vLLM engine, and the TRL side of `rl_vs_trl_vllm` with it, sets `VLLM_USE_FLASHINFER_SAMPLER=0` itself.',
    '',
    'Each part runs in a process of its own and ends within its limit: train 900 s, engine 600 s, rl_vs_trl 1,200 s, rl_vs_trl_vllm 1,500 s (each vLLM side also within `--side-timeout-s`, 600 s), logprobs 600 s (`PART_LIMITS_S` in benchmarks/bench_gpu.py; `--part-timeout-s S` sets one limit for all). A part past its limit is killed with its process group and recorded as `{"error": "no result within N s"}`; the JSON is rewritten as each part ends, so a hung part costs its limit and nothing measured before it. `--profile` adds the train step\'s top kernels (eager and compiled).',
]


def render(report: dict) -> str:
    ceiling = report["ceiling_gflops"]
    heads = {name: headline(name, entry, ceiling) for name, entry in report["benchmarks"].items()}
    lines = ["# rlpipe benchmarks", "",
             "Generated by `make bench` (benchmarks/run_all.py) — do not edit by hand. Raw results: "
             "[BENCHMARKS.json](BENCHMARKS.json) (a copy of `runs/bench/all.json`).", "",
             f"Machine: {report['machine']['platform']}, Python {report['machine']['python']}, torch "
             f"{report['machine']['torch']}, {report['machine']['cpus']} CPUs, {report['machine']['torch_threads']} "
             f"torch threads by default. Load average before / after: {fmt_load(report.get('loadavg_start'))} / "
             f"{fmt_load(report.get('loadavg_end'))} (the last `run_all`). The benchmarks took "
             f"{sum(e.get('seconds', 0) for e in report['benchmarks'].values()) / 60:.1f} min in all.", "",
             "GPU figures (one NVIDIA GPU, which its tables name: train step MFU, engine, rlpipe vs TRL, `configs/gpu.toml`) are in "
             "[BENCHMARKS_GPU.md](BENCHMARKS_GPU.md), written by `benchmarks/bench_gpu.py` where a GPU is present "
             "(how to run it: [On a CUDA machine](#on-a-cuda-machine), below the summary).", "",
             "Timings come from a CPU that other processes shared (the load averages above), so read "
             "them as ranges, not digits." + (" This was a `--quick` run (fewer repeats and steps)." if report.get("quick")
                                      else ""), "",
             "## Summary", ""]
    lines += table(["benchmark", "headline"],
                   [[f"[{name}](#{anchor_of(BENCHMARKS[name])})", heads[name][0]] for name in report["benchmarks"]])
    lines += ["", *ON_A_GPU]
    lines += not_measured([name for name in BENCHMARKS if name not in report["benchmarks"]])
    lines += ["", "## The ceiling: matrix-multiply rate", "",
              "| dtype | GFLOP/s |", "|---|---|"]
    lines += [f"| {dtype} | {rate:,.0f} |" for dtype, rate in ceiling.items()]
    lines += ["", "Training MFU = 6 · parameters · real tokens / time / this rate.", ""]
    for name, entry in report["benchmarks"].items():
        lines += [f"## {BENCHMARKS[name]}", "",
                  f"`python -m benchmarks.bench_{name}` ({entry['seconds']:.0f} s). {heads[name][0]}.", ""]
        if "error" in entry:
            lines += ["Failed:", "", "```", entry["error"].strip(), "```", ""]
            continue
        lines += [*heads[name][1], "", "<details><summary>Raw results</summary>", ""]
        lines += ["| measure | value |", "|---|---|"]
        lines += [f"| {key} | {fmt(value)} |" for key, value in flatten(entry["results"])]
        lines += ["", "</details>", ""]
    return "\n".join(lines)


def not_measured(names: list[str]) -> list[str]:
    """The section naming benchmarks with no result yet, and the command that measures each."""
    if not names:
        return []
    lines = ["", "## Not measured yet", "",
             "These benchmarks have no result in this document yet; each runs on its own, from the repository root "
             "(`--help` lists its settings), and `python -m benchmarks.run_all --only NAME` adds its section here:", ""]
    return lines + [f"- {BENCHMARKS[name]}: `python -m benchmarks.bench_{name}`" for name in names]


def fmt_load(load) -> str:
    return "–" if not load else " ".join(f"{x:.1f}" for x in load)


def anchor_of(title: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="",
                        help="comma-separated subset of " + ",".join(BENCHMARKS) + " (the others keep their "
                        "results from the last runs/bench/all.json, with its machine, load averages and ceiling)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller runs: " + "; ".join(f"{k} {' '.join(v)}" for k, v in QUICK_ARGS.items()))
    parser.add_argument("--render", action="store_true", help="only re-render the document from runs/bench/all.json")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    out_dir = ROOT / "runs" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = json.loads((out_dir / "all.json").read_text()) if (out_dir / "all.json").is_file() else None
    if args.render:
        if previous is None:
            raise ValueError(f"nothing to render: {out_dir / 'all.json'} does not exist")
        report = previous
    else:
        report = run_all(names, out_dir, args.quick, previous if args.only else None)
        write_results(out_dir / "all.json", report)
    doc = Path(args.doc)
    write_atomic(doc, render(report))
    # the raw results beside the document, so a clone has them without re-running
    write_results(doc.with_suffix(".json"), report)
    print(f"bench: wrote {doc} and {doc.with_suffix('.json')}")
    return 0


def run_all(names: list[str], out_dir: Path, quick: bool, previous: dict | None) -> dict:
    """Run `names` one after another; with `previous`, keep its results for the others."""
    start, load_start = time.perf_counter(), os.getloadavg()
    if previous is not None:  # the others' figures stay as their run measured them: its machine and ceiling
        report = {**previous, "benchmarks": {}}
    else:
        report = {"machine": machine(), "loadavg_start": load_start, "quick": quick, "benchmarks": {},
                  "ceiling_gflops": {"float32": matmul_gflops(torch.float32), "bfloat16": matmul_gflops(torch.bfloat16)}}
    kept = (previous or {}).get("benchmarks", {})
    for name in BENCHMARKS:
        if name in names:
            print(f"bench: {name} ...", flush=True)
            report["benchmarks"][name] = run_benchmark(name, out_dir / f"{name}.json", quick)
            print(f"bench: {name} done in {report['benchmarks'][name]['seconds']:.0f} s"
                  + (" (FAILED)" if "error" in report["benchmarks"][name] else ""), flush=True)
        elif name in kept:
            report["benchmarks"][name] = kept[name]
    if previous is None:
        report["loadavg_end"] = os.getloadavg()
        report["seconds"] = time.perf_counter() - start
    return report


if __name__ == "__main__":
    sys.exit(main())
