"""rlpipe against TRL's GRPOTrainer, both sampling with vLLM colocated on the one GPU.

Same model (a preset, seed 0, saved once as a Hugging Face checkpoint: TRL's vLLM loads it from
its path), prompts, group size, completion length, optimizer and precision on both sides; vLLM
with CUDA graphs and sleep mode (level 2, weights re-pushed at each wake-up) on both, gradient
checkpointing off. Each side runs in a process of its own: TRL builds its vLLM with the external
launcher and rlpipe's engine builds one in process, and vLLM's distributed state cannot be set up
twice in one process.

Per side: seconds per step (median after the first), tokens/s, and the weight sync of each step:
`load_s`, copying the trainer's tensors into vLLM's (TRL's `sync_weights`, rlpipe's push), and
`wake_s`, re-mapping vLLM's weight memory before it, reported apart.

    python -m benchmarks.bench_gpu --parts rl_vs_trl_vllm          # both sides, into gpu.json
    python -m benchmarks.gpu_vllm --side rlpipe --checkpoint DIR --out part.json   # one side
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rlpipe.models.device import model_device, synchronize

from benchmarks.gpu_steps import rlpipe_steps, trl_steps
from benchmarks.results import write_atomic

SIDES = ("trl", "rlpipe", "rlpipe_compiled")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def time_calls(owner: Any, name: str, device: torch.device, calls: list[dict]) -> None:
    """Replace `owner.name` by a wrapper that appends {name, start, end, args} of each call (the
    device synchronised on both ends) to `calls`."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        synchronize(device)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            synchronize(device)
            calls.append({"name": name, "start": start, "end": time.perf_counter(),
                          "args": repr(args) + repr(kwargs) if name == "wake_up" else ""})

    setattr(owner, name, timed)


def sync_seconds(calls: list[dict], load_name: str) -> dict[str, list[float]]:
    """Per load call: its seconds less any weight wake-up inside it (TRL wakes inside its sync),
    and the seconds of the weight wake-ups (rlpipe wakes just before its push)."""
    wakes = [c for c in calls if c["name"] == "wake_up" and "weights" in c["args"]]
    loads = []
    for load in (c for c in calls if c["name"] == load_name):
        inner = sum(w["end"] - w["start"] for w in wakes if load["start"] <= w["start"] <= load["end"])
        loads.append(load["end"] - load["start"] - inner)
    return {"load_s": loads, "wake_s": [w["end"] - w["start"] for w in wakes]}


def summarise(side: dict, sync: dict[str, list[float]]) -> dict:
    """The side's step figures with the median weight sync after the first step's."""
    later = {key: values[1:] or values for key, values in sync.items()}
    return {**side, **sync, "load_s_median": statistics.median(later["load_s"]) if later["load_s"] else None,
            "wake_s_median": statistics.median(later["wake_s"]) if later["wake_s"] else None}


def rlpipe_side(args, checkpoint: Path, compile: bool) -> dict:
    """rlpipe's steps with its colocated vLLM engine."""
    from rlpipe.engines.vllm_engine import VllmEngine
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.tasks.setup import place_model

    on_cuda = torch.cuda.is_available()
    model = place_model(load_model(checkpoint), "cuda" if on_cuda else "cpu", compile=compile)
    engine = VllmEngine(model, dtype="bfloat16" if on_cuda else "float32",
                        gpu_memory_utilization=args.vllm_memory, max_model_len=args.max_model_len,
                        enforce_eager=not on_cuda, sleep_between_calls=True)
    calls: list[dict] = []
    time_calls(engine, "_push_weights", model_device(model), calls)
    time_calls(engine._llm, "wake_up", model_device(model), calls)
    try:
        steps = rlpipe_steps(model, load_tokenizer(checkpoint), args, engine=engine)
    finally:
        engine.close()
    return summarise(steps, sync_seconds(calls, "_push_weights"))


def trl_side(args, checkpoint: Path, workdir: Path) -> dict:
    from rlpipe.engines.vllm_lifecycle import use_sampler_without_flashinfer

    # TRL builds its own vLLM: without FlashInfer, vLLM's GPU sampler fails to start unless it takes
    # its PyTorch path, which rlpipe's engine chooses there; the same decision, before vLLM loads
    use_sampler_without_flashinfer()
    import trl
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.tasks.setup import place_model

    on_cuda = torch.cuda.is_available()
    model = place_model(load_model(checkpoint), "cuda" if on_cuda else "cpu")
    model.config._name_or_path = str(checkpoint)  # where TRL's vLLM loads the model from
    calls: list[dict] = []

    def watch(trainer) -> None:
        generation = trainer.vllm_generation
        time_calls(generation, "sync_weights", model_device(model), calls)
        time_calls(generation.llm, "wake_up", model_device(model), calls)

    vllm = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.vllm_memory,
            "vllm_enable_sleep_mode": on_cuda, "vllm_max_model_length": args.max_model_len}
    steps = trl_steps(model, load_tokenizer(checkpoint), args, workdir, vllm=vllm, on_trainer=watch)
    return {"trl_version": trl.__version__, **summarise(steps, sync_seconds(calls, "sync_weights"))}


def run_side(side: str, args, checkpoint: Path, workdir: Path) -> dict:
    """One side in its own process; its figures, or why it has none."""
    out = workdir / f"{side}.json"
    command = [sys.executable, "-m", "benchmarks.gpu_vllm", "--side", side, "--checkpoint", str(checkpoint),
               "--out", str(out), *shared_argv(args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.side_timeout_s)
    except subprocess.TimeoutExpired as expired:  # the other sides still run and are reported
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        return {"error": f"no result within --side-timeout-s {args.side_timeout_s:g}: {(stderr or '')[-3000:]}"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(out.read_text())


def bench_rl_vs_trl_vllm(args, preset: str = "qwen3-0.6b") -> dict:
    """Both sides on one saved model; step-time and sync ratios rlpipe / TRL."""
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.training.checkpoint_io import save_checkpoint

    tokenizer = build_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    result: dict[str, Any] = {"model": f"{preset} preset (char vocabulary)", "prompts": args.prompts,
                              "group": args.group, "max_new_tokens": args.max_new, "steps": args.steps,
                              "vllm_gpu_memory_utilization": args.vllm_memory}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(preset, len(tokenizer), seed=0, **ids)
        checkpoint = save_checkpoint(Path(tmp) / "start", 0, model, tokenizer)
        del model
        for side in args.sides:
            result[side] = run_side(side, args, checkpoint, Path(tmp))
            print(json.dumps({side: result[side]}), flush=True)  # in the log should a later side hang
    trl_side_ = result.get("trl", {})
    for side in (s for s in args.sides if s != "trl"):
        if "seconds_per_step" in trl_side_ and "seconds_per_step" in result[side]:
            result[f"{side}_step_time_ratio"] = result[side]["seconds_per_step"] / trl_side_["seconds_per_step"]
    print(json.dumps({k: v for k, v in result.items() if k not in SIDES}), flush=True)
    return result


def render_rl_vs_trl_vllm(r: dict) -> list[str]:
    """The Markdown section of BENCHMARKS_GPU.md for this comparison."""
    def cell(value, spec: str = ".3g") -> str:
        return "-" if value is None else format(value, spec)

    lines = ["## One RL step: rlpipe vs TRL GRPOTrainer, both with vLLM colocated", "",
             f"{r['model']}; {r['prompts']} prompts x {r['group']} completions of at most {r['max_new_tokens']} "
             f"tokens; bf16; vLLM with CUDA graphs, sleep mode (level 2) and {r['vllm_gpu_memory_utilization']:.0%} "
             f"of the GPU on both sides; median of steps 2..{r['steps']}. Weight sync: copying the trainer's "
             "tensors into vLLM (load), and re-mapping vLLM's weight memory before it (wake).", "",
             "| side | s/step | tokens/s | weight load s | weight wake s | vs TRL |", "|---|---|---|---|---|---|"]
    names = {"trl": "TRL (`use_vllm`, colocate)", "rlpipe": "rlpipe (`engine.type = \"vllm\"`)",
             "rlpipe_compiled": "rlpipe, `train.compile`"}
    for side, name in names.items():
        figures = r.get(side)
        if figures is None:
            continue
        if "error" in figures:
            lines.append(f"| {name} | failed: {figures['error'][-160:]!r} | | | | |")
            continue
        ratio = r.get(f"{side}_step_time_ratio")
        lines.append(f"| {name} | {figures['seconds_per_step']:.2f} | {cell(figures.get('tokens_per_second'), ',.0f')} | "
                     f"{cell(figures.get('load_s_median'))} | {cell(figures.get('wake_s_median'))} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return [*lines, "", "Targets: step time <= 0.5x TRL's; weight sync <= 0.2 s for 0.6B.", ""]


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of GPU memory, both sides")
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM's longest prompt + completion")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--side-timeout-s", type=float, default=600)


def shared_argv(args) -> list[str]:
    return ["--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
            "--steps", str(args.steps), "--vllm-memory", str(args.vllm_memory),
            "--max-model-len", str(args.max_model_len)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("--prompts", 32), ("--group", 8), ("--max-new", 128), ("--steps", 5)):
        parser.add_argument(name, type=int, default=default)
    add_vllm_arguments(parser)
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if args.side == "trl":
            result = trl_side(args, args.checkpoint, Path(workdir))
        else:
            result = rlpipe_side(args, args.checkpoint, compile=args.side != "rlpipe")
    write_atomic(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
