"""GPU benchmark (one CUDA device): rlpipe at Qwen3-0.6B scale, and TRL's GRPOTrainer beside it.

Its parts, in one process on one GPU (rl_vs_trl_vllm starts one process per side):
- train: the packed train step of the `qwen3-0.6b` preset at its real 151,936-token vocabulary
  (0.60B parameters), RL-like packs of 256-1,024-token sequences: seconds, real tokens/s, model
  FLOP utilisation (MFU: 6 x matmul parameters x tokens + causal attention, over the GPU's dense
  bf16 peak), peak memory; bf16 autocast over fp32 master weights (the default), pure bf16, and
  each with activation checkpointing or with `train.compile` (compiled decoder layers; its first
  step, compile included, is reported apart).
- engine: the torch engine decoding on the GPU in bf16 (tokens/s), the cost of its weight "sync"
  (it re-reads the trainer's tensors, cast to bf16, at each generate: no copy through disk), and
  the cost of writing the Hugging Face checkpoint that an HTTP engine (vLLM/SGLang server) loads;
  then the same calls with `engine.cuda_graphs` (engines/decode_graphs.py): capture, replay, and
  the per-call weight copy into the graphs' buffers.
- rl_vs_trl: one RL step (generate -> reward -> advantages -> pack -> train) of rlpipe's stage
  functions against TRL's GRPOTrainer on the same model, prompts, group size, completion length,
  optimizer and precision (bf16), gradient checkpointing off on both sides, and rlpipe once more
  with `train.compile` and `engine.cuda_graphs` on. TRL generates with transformers' `generate`
  here (the JSON's `notes` say so); both sides' steps are in benchmarks/gpu_steps.py.
- rl_vs_trl_vllm (not in the default parts; needs vLLM): the same comparison with both sides
  sampling from vLLM colocated, and each side's weight-sync seconds (benchmarks/gpu_vllm.py).

- logprobs: the chunked selective log-softmax alone, previous version vs eager vs compiled kernels
  (benchmarks/gpu_logprobs.py).

    python -m benchmarks.bench_gpu [--parts train engine rl_vs_trl rl_vs_trl_vllm logprobs] [--out runs/bench/gpu.json]
    python -m benchmarks.bench_gpu --quick      # every GPU figure in one table (benchmarks/gpu_quick.py)
    python -m benchmarks.bench_gpu --render docs/BENCHMARKS_GPU.json     # -> docs/BENCHMARKS_GPU.md

Every part runs in a process of its own and ends within its stated limit (PART_LIMITS_S, or
`--part-timeout-s` for all): one that runs past it is killed with its process group (a vLLM
side included) and the JSON records `{"error": "no result within N s"}` for it, and the next
part starts on a GPU no earlier part holds memory on.

The document is generated from the JSON (which also holds the `rlpipe run configs/gpu.toml`
figures read from its tables); `make bench` on a machine without CUDA leaves both as they are.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.device import synchronize
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.tasks.setup import place_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

from benchmarks.gpu_logprobs import bench_logprobs_gpu
from benchmarks.gpu_quick import QUICK_LIMITS_S, QUICK_PARTS, quick_part, render_quick
from benchmarks.gpu_report import render
from benchmarks.gpu_steps import rlpipe_steps, trl_steps
from benchmarks.gpu_vllm import add_vllm_arguments, bench_rl_vs_trl_vllm, vllm_installed
from benchmarks.results import write_atomic, write_results
from benchmarks.timing import timed

QWEN3_VOCAB = 151_936
# dense bf16 tensor-core peaks (no sparsity), by device name
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def matmul_parameters(model) -> int:
    """Parameters that take part in a matmul per token: the blocks' matrices and the lm_head."""
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() >= 2)
    return blocks + model.lm_head.weight.numel()


def train_flops(model, lengths: list[int]) -> float:
    """fwd + bwd FLOPs of a step: 6 N T for the matmuls, 3 x 4 Hq D (causal pairs) per layer."""
    cfg = model.config
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    attention = 3 * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    return 6 * matmul_parameters(model) * sum(lengths) + attention


def rl_like_sequences(n: int, vocab: int, seed: int, low: int = 256, high: int = 1024) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(low, high + 1, (1,), generator=g))
        tokens = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(Sequence(tokens=tokens, weights=[1.0] * length, sample_id=f"s{i}"))
    return out


# (weights dtype, activation checkpointing, train.compile); compile with checkpointing is refused
TRAIN_VARIANTS = [(w, ckpt, comp) for w in ("float32", "bfloat16")
                  for ckpt, comp in ((False, False), (True, False), (False, True))]


def train_step_seconds(batches, seqs, weights_dtype: str, checkpointing: bool, compile: bool, repeats: int):
    """Median seconds of a full optimizer step, the first step's seconds (compiling, when
    `compile`), its FLOPs and the parameter count."""
    model = build_model("qwen3-0.6b", QWEN3_VOCAB, seed=0, pad_token_id=0, eos_token_id=1)
    place_model(model, "cuda", weights_dtype, checkpointing, compile)
    optimizer = build_optimizer(model, lr=1e-5)

    def step():
        forward_backward(model, batches, nll_loss, StepOptions(autocast=True))
        optim_step(model, optimizer, None, max_grad_norm=1.0)

    first = timed(step, repeats=1, warmup=0)[0]
    seconds = statistics.median(timed(step, repeats))
    return seconds, first, train_flops(model, [len(s.tokens) for s in seqs]), \
        sum(p.numel() for p in model.parameters())


def step_sequences(tokens_per_step: int) -> tuple[list[Sequence], int]:
    """RL-like sequences filling one train step of at most `tokens_per_step` tokens, and their count."""
    seqs, total = [], 0
    for s in rl_like_sequences(4 * tokens_per_step // 512, QWEN3_VOCAB, seed=0):
        if total + len(s.tokens) > tokens_per_step:
            break
        seqs.append(s)
        total += len(s.tokens)
    return seqs, total


def bench_train(tokens_per_step: int, token_budget: int, repeats: int) -> list[dict]:
    seqs, total = step_sequences(tokens_per_step)
    batches = pack(seqs, token_budget)
    rows = []
    for weights_dtype, checkpointing, compile in TRAIN_VARIANTS:
        torch._dynamo.reset()  # the last variant's compiled code, and whatever its guards keep alive
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seconds, first, flops, parameters = train_step_seconds(batches, seqs, weights_dtype, checkpointing,
                                                               compile, repeats)
        peak = peak_flops()
        rows.append({
            "weights": weights_dtype, "activation_checkpointing": checkpointing, "compile": compile,
            "first_step_seconds": first, "parameters": parameters, "tokens": total, "micro_batches": len(batches),
            "seconds": seconds, "tokens_per_second": total / seconds,
            "tflops": flops / seconds / 1e12, "mfu": None if peak is None else flops / seconds / peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile_train_step(tokens_per_step: int, token_budget: int, path: Path, compile: bool = False) -> None:
    """Where a default-precision train step spends GPU time: the profiler's top kernels."""
    from torch.profiler import ProfilerActivity, profile

    seqs = rl_like_sequences(tokens_per_step // 640, QWEN3_VOCAB, seed=0)
    batches = pack(seqs, token_budget)
    model = place_model(build_model("qwen3-0.6b", QWEN3_VOCAB, seed=0, pad_token_id=0, eos_token_id=1), "cuda",
                        compile=compile)
    optimizer = build_optimizer(model, lr=1e-5)

    def step():
        forward_backward(model, batches, nll_loss, StepOptions(autocast=True))
        optim_step(model, optimizer, None, max_grad_norm=1.0)

    timed(step, repeats=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(torch.device("cuda"))
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))


def bench_engine(prompts: int, n: int, max_new: int) -> dict:
    """The torch engine in bf16, eager decode; then the same calls with `cuda_graphs=True`."""
    from rlpipe.engines import qwen3_fast

    tok = build_tokenizer()
    model = build_model("qwen3-0.6b", QWEN3_VOCAB, seed=0, pad_token_id=0, eos_token_id=1)
    place_model(model, "cuda")
    engine = TorchEngine(model, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, len(tok), (int(torch.randint(16, 64, (1,), generator=g)),), generator=g).tolist()
             for _ in range(prompts)]
    params = SamplingParams(n=n, max_new_tokens=max_new, seed=0)  # no stop tokens: every row runs max_new
    times = timed(lambda: engine.generate(batch, params), repeats=3, warmup=1)
    sync = timed(lambda: qwen3_fast.QwenWeights.from_model(model, torch.bfloat16, "cuda"), repeats=5)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model.save_pretrained(tmp)
        save_seconds = time.perf_counter() - start
    generated = prompts * n * max_new
    out = {"prompts": prompts, "n": n, "max_new_tokens": max_new, "max_batch_size": engine.max_batch_size,
           "seconds": statistics.median(times), "tokens_per_second": generated / statistics.median(times),
           "sync_seconds_shared_weights": statistics.median(sync),
           "checkpoint_write_seconds": save_seconds}
    engine.close()
    out["cuda_graphs"] = bench_engine_graphs(model, batch, params, generated)
    print(json.dumps(out), flush=True)
    return out


def bench_engine_graphs(model, batch, params, generated: int) -> dict:
    """`cuda_graphs=True`: the first call (it captures the graphs), later calls (replays), and
    the per-call copy of the weights into the graphs' buffers."""
    from rlpipe.engines import qwen3_fast

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = TorchEngine(model, dtype=torch.bfloat16, cuda_graphs=True)
    first = timed(lambda: engine.generate(batch, params), repeats=1, warmup=0)[0]
    times = timed(lambda: engine.generate(batch, params), repeats=3, warmup=0)
    weights = qwen3_fast.QwenWeights.from_model(model, torch.bfloat16, "cuda")
    with torch.inference_mode():
        refresh = timed(lambda: engine._graphs.bind(weights), repeats=5)
    out = {"first_call_seconds": first, "seconds": statistics.median(times),
           "tokens_per_second": generated / statistics.median(times), "graphs": engine._graphs.captures,
           "weight_copy_seconds": statistics.median(refresh),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    engine.close()
    return out


def bench_rl_vs_trl(args) -> dict:
    tokenizer = build_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    base = build_model("qwen3-0.6b", len(tokenizer), seed=0, **ids)
    result = {"model": "qwen3-0.6b preset (char vocabulary)", "prompts": args.prompts, "group": args.group,
              "max_new_tokens": args.max_new, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            import trl

            result["trl_version"] = trl.__version__
            result["trl"] = trl_steps(place_model(copy.deepcopy(base), "cuda"), tokenizer, args, Path(tmp))
        except Exception as error:  # noqa: BLE001 - the JSON says why TRL has no figure
            result["trl"] = {"error": f"{type(error).__name__}: {error}"}
        torch.cuda.empty_cache()
        result["rlpipe"] = rlpipe_steps(place_model(copy.deepcopy(base), "cuda"), tokenizer, args)
        torch.cuda.empty_cache()
        # the same steps with train.compile and engine.cuda_graphs on (step 1, which compiles and
        # captures, is left out of the median like every side's first step)
        result["rlpipe_fast"] = rlpipe_steps(place_model(copy.deepcopy(base), "cuda", compile=True),
                                             tokenizer, args, cuda_graphs=True)
        torch._dynamo.reset()
    if "seconds_per_step" in result["trl"]:
        for side, key in (("rlpipe", "step_time_ratio"), ("rlpipe_fast", "step_time_ratio_fast")):
            result[key] = result[side]["seconds_per_step"] / result["trl"]["seconds_per_step"]
    print(json.dumps({k: v for k, v in result.items() if k not in ("rlpipe", "trl")}), flush=True)
    return result


# seconds each part may run, measured H100 times with room to spare (a first compile included)
PART_LIMITS_S = {"train": 900, "engine": 600, "rl_vs_trl": 1200, "rl_vs_trl_vllm": 1500, "logprobs": 600}


def run_limited(command: list[str], limit_s: float, out: Path) -> dict:
    """Run `command` (which writes its result as JSON to `out`) for at most `limit_s` seconds in a
    new process group, killed whole past the limit; its result, or {"error": why there is none}."""
    process = subprocess.Popen(command, stdout=None, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return {"error": f"no result within {limit_s:g} s (the part's limit; --part-timeout-s changes it)"}
    if process.returncode != 0 or not out.is_file():
        return {"error": f"exit status {process.returncode}: {(stderr or '')[-3000:]}"}
    return json.loads(out.read_text())


def run_part_in_process(name: str, args: argparse.Namespace) -> dict:
    """One part in a child process of this module (`--one-part`), within its limit (a `--quick`
    part's own, gpu_quick.QUICK_LIMITS_S, unless --part-timeout-s)."""
    limit = args.part_timeout_s or (QUICK_LIMITS_S if args.quick else PART_LIMITS_S)[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{name}-") as folder:
        out = Path(folder) / "part.json"
        options = {k: v for k, v in vars(args).items() if k not in ("parts", "out", "render", "profile", "one_part")}
        command = [sys.executable, "-m", "benchmarks.bench_gpu", "--one-part", name, "--out", str(out),
                   "--options-json", json.dumps(options)]
        return run_limited(command, limit, out)


def run_quick(args: argparse.Namespace, report: dict) -> dict:
    """`--quick`: gpu_quick's parts, each in its own process within its limit; one table printed,
    one JSON written (kept after each part)."""
    for name in args.quick_parts:
        print(f"bench_gpu --quick: {name} (limit {args.part_timeout_s or QUICK_LIMITS_S[name]:g} s)", flush=True)
        report[name] = run_part_in_process(name, args)
        write_results(args.out, report)
    print("\n".join(render_quick(report)), flush=True)
    return report


def measured_on() -> str:
    """The hardware and software a report was measured on: GPU, torch, transformers, TRL and vLLM
    (those installed)."""
    import importlib.metadata

    versions = []
    for name in ("transformers", "trl", "vllm"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join([f"one {torch.cuda.get_device_name()}", f"torch {torch.__version__}", *versions])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["train", "engine", "rl_vs_trl", "logprobs"],
                        choices=["train", "engine", "rl_vs_trl", "rl_vs_trl_vllm", "logprobs"])
    parser.add_argument("--tokens-per-step", type=int, default=32_768)
    parser.add_argument("--token-budget", type=int, default=16_384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="runs/bench/gpu.json")
    parser.add_argument("--profile", action="store_true", help="also write the train step's top kernels")
    parser.add_argument("--render", metavar="JSON", help="only write the Markdown next to this JSON")
    parser.add_argument("--part-timeout-s", type=float, default=None,
                        help="seconds every part may run (default: each part's own, PART_LIMITS_S)")
    parser.add_argument("--quick", action="store_true",
                        help="every GPU figure in one table within about 5 minutes (benchmarks/gpu_quick.py)")
    parser.add_argument("--quick-parts", nargs="+", choices=QUICK_PARTS, default=list(QUICK_PARTS),
                        help="with --quick: only these parts")
    parser.add_argument("--one-part", help=argparse.SUPPRESS)  # the child process of one part
    parser.add_argument("--options-json", help=argparse.SUPPRESS)
    add_vllm_arguments(parser)
    args = parser.parse_args(argv)
    if args.options_json:
        vars(args).update(json.loads(args.options_json))
    if args.render:
        report = json.loads(Path(args.render).read_text())
        write_atomic(Path(args.render).with_suffix(".md"), render(report))
        return report
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU (torch sees none)")
    report = {"measured": measured_on(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "peak_bf16_tflops": (peak_flops() or 0) / 1e12,
              "notes": ["rl_vs_trl: TRL generates with transformers' generate and rlpipe with its torch engine"
                        + ("; rl_vs_trl_vllm: both with vLLM colocated" if vllm_installed() else
                           "; vLLM is not installed")]}
    parts = {"train": lambda: bench_train(args.tokens_per_step, args.token_budget, args.repeats),
             "engine": lambda: bench_engine(prompts=64, n=8, max_new=256),
             "rl_vs_trl": lambda: bench_rl_vs_trl(args),
             "rl_vs_trl_vllm": lambda: bench_rl_vs_trl_vllm(args),
             "logprobs": lambda: bench_logprobs_gpu(args.tokens_per_step, args.repeats)}
    if args.one_part:
        write_results(args.out, quick_part(args.one_part, args) if args.quick else parts[args.one_part]())
        return report
    if args.quick:
        return run_quick(args, report)
    for name in args.parts:
        report[name] = run_part_in_process(name, args)
        print(json.dumps({name: "error" if "error" in report[name] else "done"}), flush=True)
        write_results(args.out, report)  # each part kept as it ends: a later one may fail or hang
    if args.profile:  # eager, then compiled: what the fused layers leave
        profile_train_step(args.tokens_per_step, args.token_budget, Path(args.out).with_suffix(".profile.txt"))
        profile_train_step(args.tokens_per_step, args.token_budget,
                           Path(args.out).with_suffix(".profile-compile.txt"), compile=True)
    return report


if __name__ == "__main__":
    main()
