"""`python -m benchmarks.bench_gpu --quick`: every GPU figure in one table and one JSON.

Parts, each in a process of its own within its limit (QUICK_LIMITS_S; a part past it is killed
and recorded as such, and the next one starts on a GPU no earlier part holds memory on):
- head: the vocabulary head alone, 32,768 tokens x Qwen3's 151,936-token vocabulary at hidden
  1,024: forward + backward seconds and peak extra memory of the chunked head (compiled kernels,
  what a compiled train step runs) and the fused head (Cut Cross-Entropy), in bf16 autocast over
  fp32 weights and in pure bf16;
- train: the compiled qwen3-0.6b train step (32,768 tokens, 2 micro-batches) for {chunked, fused
  head} x {fp32 master weights with bf16 autocast, bf16 weights}: s/step, MFU, peak memory;
- memory: one full-parameter train step (8,192 tokens) of the qwen3-0.6b, 1.7b, 4b and 8b shapes
  under the memory-lean options (bf16 weights and AdamW state, stochastically rounded where
  torchao is installed, activation checkpointing, fused head): its peak, and what the trainer holds between steps, which is all a colocated vLLM, asleep
  while the trainer steps, has to share the GPU with while it generates;
- rl_vllm: one RL step of rlpipe and of TRL's GRPOTrainer, each with vLLM colocated (3 steps, the
  first left out; benchmarks/gpu_vllm.py), where vLLM and TRL are installed;
- tests: `pytest -m gpu tests/gpu`, its summary line.

It imports nothing beyond torch, transformers and, where installed, cut-cross-entropy, vLLM and TRL.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys

import torch
from rlpipe.models.presets import build_model
from rlpipe.tasks.setup import place_model
from rlpipe.training.batch import pack
from rlpipe.training.fused_head import fused_head_unavailable_reason, fused_logprobs
from rlpipe.training.logprobs import selective_log_softmax
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

from benchmarks.timing import timed

# seconds each part may run: about twice what it took on one H100 or H200 (compiles included)
QUICK_LIMITS_S = {"head": 90, "train": 240, "memory": 240, "rl_vllm": 420, "tests": 300}
QUICK_PARTS = tuple(QUICK_LIMITS_S)
SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")
GPU_GIB = 80  # the GPU our users have: a shape fits where its figures stay under it
VOCAB, HIDDEN = 151_936, 1024


def heads_available() -> list[str]:
    """The heads that can run here: "chunked", and "fused" where Cut Cross-Entropy can."""
    return ["chunked"] + ([] if fused_head_unavailable_reason("cuda") else ["fused"])


def head_rows(tokens: int = 32_768, repeats: int = 5) -> list[dict]:
    """Forward + backward of the head alone, per precision and head."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for precision, dtype in (("bf16 autocast, fp32 weights", torch.float32), ("pure bf16", torch.bfloat16)):
        h = (torch.randn(tokens, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.25).to(dtype).requires_grad_()
        w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.25).to(dtype).requires_grad_()
        labels = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=gen)
        for head in heads_available():
            rows.append({"precision": precision, "head": head, "tokens": tokens, "vocab": VOCAB,
                         **_head_figures(h, w, labels, head, repeats)})
            print(rows[-1], flush=True)
        h = w = None
        torch.cuda.empty_cache()
    return rows


def _head_figures(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, head: str, repeats: int) -> dict:
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = (fused_logprobs(h, w, labels) if head == "fused"
                   else selective_log_softmax(h, w, labels, 1024, kernels="compiled"))
        out.sum().backward()
        h.grad = w.grad = None

    step()  # compiles the chunked kernels
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    seconds = statistics.median(timed(step, repeats, warmup=1))
    return {"fwd_bwd_seconds": seconds, "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def _free_gpu() -> None:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def train_rows(tokens_per_step: int = 32_768, token_budget: int = 16_384, repeats: int = 3) -> list[dict]:
    """The compiled qwen3-0.6b step per head and weights dtype (bench_gpu's train part's measure)."""
    from benchmarks.bench_gpu import peak_flops, step_sequences, train_flops

    seqs, total = step_sequences(tokens_per_step)
    batches = pack(seqs, token_budget)
    rows = []
    for weights in ("float32", "bfloat16"):
        for head in heads_available():
            _free_gpu()
            model = build_model("qwen3-0.6b", VOCAB, seed=0, pad_token_id=0, eos_token_id=1)
            place_model(model, "cuda", weights, compile=True)
            optimizer = build_optimizer(model, lr=1e-5)

            def step(model=model, optimizer=optimizer, head=head):
                forward_backward(model, batches, nll_loss, StepOptions(autocast=True, head=head))
                optim_step(model, optimizer, None, max_grad_norm=1.0)

            first = timed(step, 1, warmup=0)[0]
            seconds = statistics.median(timed(step, repeats, warmup=0))
            flops, peak = train_flops(model, [len(s.tokens) for s in seqs]), peak_flops()
            rows.append({"weights": weights, "head": head, "compile": True, "tokens": total,
                         "micro_batches": len(batches), "first_step_seconds": first, "seconds": seconds,
                         "tokens_per_second": total / seconds, "tflops": flops / seconds / 1e12,
                         "mfu": None if peak is None else flops / seconds / peak,
                         "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})
            print(rows[-1], flush=True)
            del model, optimizer
    return rows


def lean_step_memory(preset: str, tokens: int = 8_192, sequences: int = 8) -> dict:
    """Peak and between-step GiB of one full-parameter step of `preset` under the lean options."""
    import importlib.util

    from benchmarks.bench_gpu import rl_like_sequences

    head = heads_available()[-1]
    kind = "adamw_bf16_sr" if importlib.util.find_spec("torchao") else "adamw"  # the same state size
    with torch.device("cuda"):  # initialised on the GPU: an 8B model's fp32 init on the CPU takes minutes
        model = build_model(preset, VOCAB, dtype=torch.bfloat16, seed=0, pad_token_id=0, eos_token_id=1)
    place_model(model, "cuda", "bfloat16", activation_checkpointing=True)
    _free_gpu()  # the fp32 initialisation's transient is not the step's
    optimizer = build_optimizer(model, lr=1e-6, kind=kind)
    length = tokens // sequences
    batches = pack(rl_like_sequences(sequences, VOCAB, seed=1, low=length, high=length), tokens)
    forward_backward(model, batches, nll_loss, StepOptions(autocast=True, head=head))
    optim_step(model, optimizer, None, max_grad_norm=1.0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() / 2**30  # weights + AdamW state: what stays while vLLM generates
    parameters = sum(p.numel() for p in model.parameters())
    return {"preset": preset, "parameters": parameters, "head": head, "optimizer": kind, "tokens": tokens,
            "train_peak_gib": torch.cuda.max_memory_allocated() / 2**30, "held_between_steps_gib": held,
            "vllm_weights_gib": parameters * 2 / 2**30}


def memory_rows() -> list[dict]:
    """lean_step_memory per shape, smallest first; a shape the GPU cannot hold is recorded as such."""
    rows = []
    for preset in SHAPES:
        _free_gpu()
        try:
            row = lean_step_memory(preset)
        except torch.OutOfMemoryError as error:
            row = {"preset": preset, "error": f"out of GPU memory: {str(error).splitlines()[0]}"}
        row["fits_80gib"] = fits(row)
        rows.append(row)
        print(row, flush=True)
    return rows


def fits(row: dict, gib: float = GPU_GIB, kv_gib: float = 4.0) -> bool:
    """Whether an RL step of this shape fits `gib`: the train step's peak, and the trainer's
    between-step memory plus vLLM's bf16 weights and `kv_gib` of KV cache while it generates."""
    if "error" in row:
        return False
    return row["train_peak_gib"] <= gib and row["held_between_steps_gib"] + row["vllm_weights_gib"] + kv_gib <= gib


def rl_vllm(args: argparse.Namespace) -> dict:
    """gpu_vllm's comparison at 3 steps, where vLLM and TRL are installed."""
    import importlib.util

    missing = [name for name in ("vllm", "trl") if importlib.util.find_spec(name) is None]
    if missing:
        return {"skipped": f"{' and '.join(missing)} not installed"}
    from benchmarks.gpu_vllm import bench_rl_vs_trl_vllm

    quick = argparse.Namespace(**{**vars(args), "steps": 3, "sides": ["trl", "rlpipe_compiled"],
                                  "side_timeout_s": QUICK_LIMITS_S["rl_vllm"] / 2 - 10})
    return bench_rl_vs_trl_vllm(quick)


def gpu_tests(limit_s: float) -> dict:
    """`pytest -m gpu tests/gpu`: its summary line and the failing tests' ids."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rfE"]
    try:  # wide columns: the short summary keeps each failure's message
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s,
                              env={**os.environ, "COLUMNS": "400"})
    except subprocess.TimeoutExpired:
        return {"error": f"no summary within {limit_s:g} s"}
    lines = done.stdout.splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
                   f"no summary line (exit {done.returncode})")
    return {"summary": summary, "failed": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
            "exit_status": done.returncode, "tail": "\n".join(lines[-150:])}


def quick_part(name: str, args: argparse.Namespace) -> dict | list:
    """One part's figures (run in the part's own process)."""
    if name == "tests":
        return gpu_tests(QUICK_LIMITS_S["tests"] - 10)
    return {"head": head_rows, "train": train_rows, "memory": memory_rows,
            "rl_vllm": lambda: rl_vllm(args)}[name]()


def _cell(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def render_quick(report: dict) -> list[str]:
    """The one table `--quick` prints (and docs/BENCHMARKS_GPU.md's section of it)."""
    lines = [f"## `bench_gpu --quick` ({report.get('measured', '')})", "",
             *[f"- {note}" for note in report.get("notes", [])], "",
             "| part | setting | figure |", "|---|---|---|"]
    for r in _rows(report, "head"):
        lines.append(f"| head alone, {r['tokens']:,} x {r['vocab']:,} | {r['head']}, {r['precision']} | "
                     f"fwd+bwd {r['fwd_bwd_seconds']:.4f} s, peak extra {r['peak_extra_gib']:.2f} GiB |")
    for r in _rows(report, "train"):
        lines.append(f"| train step qwen3-0.6b, compiled | {r['head']} head, {r['weights']} weights | "
                     f"{r['seconds']:.3f} s/step, MFU {_cell(r['mfu'] and 100 * r['mfu'], '.1f')}%, "
                     f"peak {r['peak_memory_gib']:.1f} GiB |")
    for r in _rows(report, "memory"):
        figure = r.get("error") or (f"train peak {r['train_peak_gib']:.1f} GiB, held between steps "
                                    f"{r['held_between_steps_gib']:.1f} GiB + vLLM bf16 weights "
                                    f"{r['vllm_weights_gib']:.1f} GiB")
        lines.append(f"| full-parameter step, lean options | {r['preset']} | {figure}; fits {GPU_GIB} GiB: "
                     f"{'yes' if r['fits_80gib'] else 'no'} |")
    fitting = [r["preset"] for r in _rows(report, "memory") if r["fits_80gib"]]
    if fitting:
        lines.append(f"| largest shape that fits {GPU_GIB} GiB | lean options | {fitting[-1]} |")
    rl = report.get("rl_vllm") or {}
    for side in ("trl", "rlpipe_compiled"):
        if isinstance(rl.get(side), dict):
            figure = rl[side].get("error") or f"{_cell(rl[side].get('seconds_per_step'))} s/step"
            lines.append(f"| RL step, vLLM colocated | {side} | {figure[:200]} |")
    if "rlpipe_compiled_step_time_ratio" in rl:
        lines.append(f"| RL step ratio | rlpipe / TRL | {rl['rlpipe_compiled_step_time_ratio']:.2f}x |")
    for key in ("skipped", "error"):
        if key in rl:
            lines.append(f"| RL step, vLLM colocated | - | {key}: {rl[key][:200]} |")
    tests = report.get("tests") or {}
    lines.append(f"| `pytest -m gpu` | tests/gpu | {tests.get('summary') or tests.get('error', '-')} |")
    for name in QUICK_PARTS:
        if isinstance(report.get(name), dict) and "error" in report[name] and name not in ("rl_vllm", "tests"):
            lines.append(f"| {name} | - | error: {report[name]['error'][:300]} |")
    return lines + [""]


def _rows(report: dict, name: str) -> list[dict]:
    rows = report.get(name)
    return rows if isinstance(rows, list) else []
