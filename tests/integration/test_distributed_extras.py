"""Data parallelism (gloo, 2 ranks) with a KL penalty, LoRA adapters, the entropy metric and the
trainer's log-probs gathered to rank 0: rank 0 leads the steps as the flows do, and the result
equals one process's. The KL reference either sits on every rank, each scoring its own share
(the flows' way, training/dist_reference.py), or on rank 0 only, its log-probs sent as batch
inputs with the micro-batches (lead_step's `batch_inputs`)."""

from __future__ import annotations

import dataclasses
import gc
from datetime import timedelta

import pytest
import torch
from rlpipe.models.presets import build_model
from rlpipe.tasks.train import train_on_batches
from rlpipe.training.dist_reference import place_reference
from rlpipe.training.dist_state import broadcast_weights
from rlpipe.training.dist_trainer import follow, lead_step, stop_followers
from rlpipe.training.distributed import data_parallel
from rlpipe.training.kl import frozen_copy, reference_logprobs
from rlpipe.training.lora import LoraOptions, add_lora
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import StepOptions, build_optimizer
from rlpipe.training.trainer import LocalTrainer, TrainOptions
from test_distributed import STEPS, VOCAB, _full_state, _packed, _steps  # same folder

from tests.ranks import run_ranks

# a reference far from the policy (another init), so a KL term missing or bound to the wrong
# micro-batch on any rank moves the weights by ~lr, far above the tolerance
KL = dict(kl_coef=0.1, kl_estimator="k3")
METRICS = ("loss", "entropy", "kl", "grad_norm")  # grad_norm: before clipping, sees a gradient's scale


def _named_steps() -> list[list]:
    """`_steps()` with sample_ids (per-batch inputs and gathered log-probs are keyed by them)."""
    return [[dataclasses.replace(s, sample_id=f"{k}-{i}") for i, s in enumerate(seqs)]
            for k, seqs in enumerate(_steps())]


def _model(lora: bool):
    model = build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    if lora:
        torch.manual_seed(1)  # adapter init; ranks > 0 get rank 0's anyway (broadcast_weights)
        add_lora(model, LoraOptions(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj")))
    return model


def _reference():
    return frozen_copy(build_model("tiny-dense", VOCAB, seed=1, pad_token_id=0, eos_token_id=0))


# (kind, lora, ref_on): every case runs in turn in one pair of rank processes (their start paid once)
CASES = [("fsdp2", False, "ranks"), ("ddp", True, "ranks"), ("fsdp2", True, "rank0")]


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file store, not a TCP port: nothing another process could take between pick and bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for number, (kind, lora, ref_on) in enumerate(CASES):
            _case(rank, kind, lora, ref_on, f"{out}.{number}")
            gc.collect()  # this case's DDP/FSDP2 wrapper gone before the next case's
    finally:
        dist.destroy_process_group()


def _case(rank: int, kind: str, lora: bool, ref_on: str, out: str) -> None:
    dp = None
    try:
        model = _model(lora)
        broadcast_weights(model)  # as tasks/ranks.py: rank 0's weights, adapters included
        dp = data_parallel(model, kind, torch.device("cpu"))
        optimizer, loss_fn = build_optimizer(model, lr=1e-3), build_rl_loss("reinforce", **KL)
        ref = _reference() if rank == 0 else None
        if ref_on == "ranks":  # as tasks/ranks.py: the others start from another init, get rank 0's
            ref = ref if rank == 0 else build_model("tiny-dense", VOCAB, seed=7, pad_token_id=0, eos_token_id=0)
            broadcast_weights(ref)
            dp.reference = place_reference(ref, kind, torch.device("cpu"))
        result = {}
        if rank == 0:
            result["metrics"], result["logprobs"] = [], []
            for seqs in _named_steps():
                batches, seen = _packed(seqs), {}
                inputs = {"ref_logprobs": reference_logprobs(ref, batches)} if ref_on == "rank0" else None
                metrics = lead_step(dp, optimizer, None, batches, loss_fn, TrainOptions(max_grad_norm=1.0, step=StepOptions(entropy=True)),
                                    batch_inputs=inputs, trainer_logprobs=seen)
                result["metrics"].append({k: metrics[k] for k in METRICS})
                result["logprobs"].append(seen)
            stop_followers(dp)
            # what rank 0's engines and checkpoints read (under FSDP2 refreshed after every step)
            result["view"] = {k: v.detach().clone() for k, v in dp.view.state_dict().items()}
        else:
            result["steps"] = follow(dp, optimizer, None, loss_fn)
        result["state"] = _full_state(model)  # collective
        torch.save(result, f"{out}.rank{rank}")
    finally:
        dp = None  # DDP before its group (else its destructor can hang at exit)
        gc.collect()


def _one_process(lora: bool, kl: dict):
    model, ref = _model(lora), _reference()
    optimizer, loss_fn = build_optimizer(model, lr=1e-3), build_rl_loss("reinforce", **kl)
    metrics, logprobs = [], []
    for step, seqs in enumerate(_named_steps(), start=1):
        batches, seen = _packed(seqs), {}
        trainer = LocalTrainer(model, optimizer, None, TrainOptions(
                    step=StepOptions(normaliser="token", autocast=False, entropy=True), max_grad_norm=1.0), reference=ref if kl else None)
        m = train_on_batches(trainer, batches, loss_fn, step=step, trainer_logprobs=seen)
        metrics.append(m)
        logprobs.append(seen)
    return model.state_dict(), metrics, logprobs


@pytest.mark.slow
def test_kl_lora_entropy_and_logprobs_on_two_ranks_equal_one_process(tmp_path):
    """Every case of CASES against one process (its run computed once per `lora`: the same for
    every kind and wherever the reference sits)."""
    torch.set_num_threads(1)
    out = str(tmp_path / "result")
    run_ranks(_rank, (2, str(tmp_path / "store"), out))
    one_process = {lora: _one_process(lora, KL) for lora in sorted({lora for _, lora, _ in CASES})}
    for number, case in enumerate(CASES):
        _check(f"{out}.{number}", case, *one_process[case[1]])


def _check(out: str, case: tuple, expected: dict, metrics: list, logprobs: list) -> None:
    _, lora, _ = case
    lead, follower = torch.load(f"{out}.rank0"), torch.load(f"{out}.rank1")
    assert follower["steps"] == STEPS, case
    for got, want in zip(lead["metrics"], metrics, strict=True):  # global figures, as one process
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (case, key)
    for got, want in zip(lead["logprobs"], logprobs, strict=True):  # every rank's micro-batches
        assert set(got) == set(want) and len(want) > 2, case
        for key, value in want.items():
            assert (got[key] - value).abs().max().item() < 1e-5, (case, key)
    assert set(lead["state"]) == set(expected) == set(lead["view"]), case
    assert all(torch.equal(lead["view"][k], v) for k, v in lead["state"].items()), case
    worst = max((lead["state"][k] - v).abs().max().item() for k, v in expected.items())
    assert worst < 1e-5, (case, worst)
    if lora:  # only the adapters moved
        start = _model(lora).state_dict()
        assert all(torch.equal(lead["state"][k], start[k]) for k in start if "lora_" not in k), case
    # the KL term matters at this tolerance: without it the weights end elsewhere
    plain, _, _ = _one_process(lora, {})
    assert max((plain[k] - v).abs().max().item() for k, v in expected.items()) > 1e-4, case
