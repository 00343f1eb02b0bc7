"""train.compile end to end: `rlpipe run configs/tiny.toml --set train.compile=true`, and compiled
layers under data parallelism (gloo, 2 ranks: DDP and FSDP2) equal one compiled process.

Slow: every process compiles its layers (tens of seconds on a cold inductor cache)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from rlpipe.models.presets import build_model
from rlpipe.training.distributed import data_parallel, shard_micro_batches
from rlpipe.training.loss_inputs import is_filler
from rlpipe.training.rl_loss import build_rl_loss
from test_distributed import _full_state, _steps, _train  # same folder: pytest puts it on sys.path
from test_resume import env_for

from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64
pytestmark = pytest.mark.slow


def test_a_tiny_run_with_compile_finishes_with_loadable_checkpoints(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "tiny.toml"),
               "--set", f"runs_root={runs}", "--set", "train.compile=true", "--set", "sft.steps=3",
               "--set", "rl.steps=2", "--set", "rl.loss.kl_coef=0.05", "--set", "threads=1"]
    # inductor logs where each graph's code went, compiled now or taken from its on-disk cache: proof
    # that it compiled, with inductor. The cache is torch's default, the one the other compile tests
    # use, so the kernels they built are not built again (a fresh one cost 50-80 s of C++ compiles).
    # torch reads TORCH_LOGS when it is imported, so this command starts cold, not from the zygote.
    done = subprocess.run(command, env=env_for(tmp_path) | {"TORCH_LOGS": "output_code"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for phase in ("sft", "rl"):
        run = runs / "tiny" / phase
        assert json.loads((run / "run.json").read_text())["status"] == "finished", phase
    assert "[__output_code] Output code written to: " in done.stderr, "train.compile=true compiled nothing"
    # the first compiled step says what its compile cost, once, and MLflow has it as perf/compile_seconds
    assert done.stderr.count("rlpipe: train.compile: step 1 spent") == 1, done.stderr[-3000:]
    sft = runs / "tiny" / "sft"
    assert json.loads((sft / "config.json").read_text())["train"]["compile"] is True
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((sft / "run.json").read_text())["mlflow_run_id"]
    compiled = client.get_metric_history(run_id, "perf/compile_seconds")
    assert compiled and compiled[0].step == 1 and compiled[0].value > 0
    last = sorted((runs / "tiny" / "rl" / "checkpoints").glob("step_*"))[-1]
    saved = load_file(last / "model.safetensors")
    assert not [k for k in saved if "_orig_mod" in k]
    model = AutoModelForCausalLM.from_pretrained(last)  # plain transformers, no rlpipe code
    assert set(saved) <= set(model.state_dict())


KINDS = ("ddp", "fsdp2")


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """Each of KINDS in turn, a fresh compiled model each, in one pair of rank processes (their
    start and first compile paid once): rank 0 saves every kind's losses and full state."""
    import torch.distributed as dist
    from rlpipe.models.compile import compile_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    dp = None
    try:
        results = {}
        for kind in KINDS:
            model = compile_layers(build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0))
            dp = data_parallel(model, kind, torch.device("cpu"))
            losses = _train(model, _steps(), build_rl_loss("reinforce"), "token",
                            lambda seqs: shard_micro_batches(seqs, 96, rank, world), dp)
            results[kind] = {"losses": losses, "state": _full_state(model)}
            dp = model = None  # this kind's DDP/FSDP2 wrapper gone before the next kind's
            gc.collect()
        if rank == 0:
            torch.save(results, out)
    finally:
        dp = None  # DDP before its group (else its destructor can hang at exit)
        gc.collect()
        dist.destroy_process_group()


def test_compiled_layers_on_two_ranks_equal_one_process(tmp_path):
    """DDP and FSDP2, each against one compiled process (the same reference for both: the same
    model, steps and micro-batches): compiled vs eager differs by float noise that AdamW magnifies
    (~4e-5 here, tests/unit/test_compile.py), which would hide a wrong rank gradient's ~1e-3."""
    from rlpipe.models.compile import compile_layers

    torch.set_num_threads(1)
    single = compile_layers(build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0))

    def both_ranks(seqs):
        return [b for rank in (0, 1) for b in shard_micro_batches(seqs, 96, rank, 2) if not is_filler(b)]

    single_losses = _train(single, _steps(), build_rl_loss("reinforce"), "token", both_ranks)
    out = str(tmp_path / "rank0.pt")
    # from the fork server, not forked from here: this process has compiled (the reference above),
    # and a rank forked from it would inherit its compile state and workers; the fork server's
    # ranks have compiled nothing and compile as a real launch does
    run_ranks(_rank, (2, str(tmp_path / "store"), out))
    results = torch.load(out)
    assert set(results) == set(KINDS)
    expected = single.state_dict()
    for kind, result in results.items():
        assert result["losses"] == pytest.approx(single_losses, rel=1e-5), kind
        assert set(result["state"]) == set(expected), kind  # no `_orig_mod.` prefixes under DDP/FSDP2 either
        # as test_distributed: float-order noise ~1e-6 after 3 AdamW steps, a wrong gradient ~1e-3
        worst = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst < 1e-5, (kind, worst)
