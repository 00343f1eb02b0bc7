"""Data parallelism on the CPU (gloo, 2 ranks): the same weights as one process after 3 steps."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
from rlpipe.models.presets import build_model
from rlpipe.training.batch import PackedBatch, Sequence, pack
from rlpipe.training.dist_state import (
    broadcast_weights,
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
)
from rlpipe.training.dist_trainer import follow, lead_step, stop_followers
from rlpipe.training.distributed import (
    balanced_budget,
    data_parallel,
    shard_micro_batches,
    share_of,
)
from rlpipe.training.loss_inputs import is_filler
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import (
    SINGLE_PROCESS,
    StepOptions,
    build_optimizer,
    forward_backward,
    optim_step,
)
from rlpipe.training.trainer import TrainOptions

from tests.ranks import run_ranks

VOCAB = 64
ONE_STEP = TrainOptions(max_grad_norm=1.0, step=StepOptions(entropy=False))
"""forward_backward's own defaults (token normaliser, no entropy), clipped at 1."""
STEPS = 3


def _steps(seed: int = 0) -> list[list[Sequence]]:
    """Three steps of RL-like sequences (advantage weights, shared prompts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        seqs = []
        for _ in range(6):
            prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(4):
                n = int(torch.randint(2, 12, (1,), generator=g))
                completion = torch.randint(1, VOCAB, (n,), generator=g).tolist()
                adv = float(torch.randn(1, generator=g))
                seqs.append(Sequence(tokens=prompt + completion, weights=[0.0] * len(prompt) + [adv] * n,
                                     prefix_len=len(prompt), loss_mask=[False] * len(prompt) + [True] * n))
        out.append(seqs)
    return out


def _train(model, steps, loss_fn, normaliser, micro_batches_of, dp=SINGLE_PROCESS,
           record: dict | None = None) -> list[float]:
    """Train on `steps`; the losses. `record` (a dict) receives each step's gradient norm before
    clipping (`grad_norms`) and every parameter's whole gradient after the first backward
    (`grads`; under FSDP2 gathered, a collective)."""
    optimizer = build_optimizer(model, lr=1e-3)
    losses = []
    for seqs in steps:
        metrics = forward_backward(model, micro_batches_of(seqs), loss_fn, StepOptions(normaliser=normaliser), ranks=dp)
        if record is not None and "grads" not in record:
            record["grads"] = {name: _whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        norm = optim_step(model, optimizer, None, max_grad_norm=1.0)["grad_norm"]
        if record is not None:
            record.setdefault("grad_norms", []).append(norm)
        losses.append(metrics["loss"])
    return losses


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain copy of a (possibly sharded DTensor) tensor."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def assert_same_gradients(got: dict, want: dict, rtol: float = 1e-4) -> None:
    """The first step's gradients, parameter by parameter, and every step's gradient norm before
    clipping, within `rtol` of one process's. Weights alone cannot show a wrong gradient scale:
    AdamW is invariant to a constant factor and the norm is clipped (a halved loss moved the
    weights by ~2e-7), while the gradients differ by the factor itself."""
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=rtol), (got["grad_norms"], want["grad_norms"])
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        scale = grad.abs().max().item()
        worst = (got["grads"][name] - grad).abs().max().item()
        assert worst <= rtol * scale + 1e-12, f"{name}: gradient off by {worst:.3g} (largest {scale:.3g})"


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


KINDS = ("ddp", "fsdp2")


def _rank(rank: int, world: int, store: str, preset: str, normaliser: str, out: str) -> None:
    """Each of KINDS in turn, a fresh model each, in one pair of rank processes (their start paid
    once): rank 0 saves every kind's losses, gradients and full state."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file store, not a TCP port: nothing another process could take between pick and bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    dp = None
    try:
        results = {}
        for kind in KINDS:
            model = build_model(preset, VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
            dp = data_parallel(model, kind, torch.device("cpu"))
            record = {}
            losses = _train(model, _steps(), build_rl_loss("reinforce"), normaliser,
                            lambda seqs: shard_micro_batches(seqs, 96, rank, world), dp, record)
            results[kind] = {"losses": losses, "state": _full_state(model), "record": record}
            dp = model = None  # this kind's DDP/FSDP2 wrapper gone before the next kind's
            gc.collect()
        if rank == 0:
            torch.save(results, out)
    finally:
        dp = None  # DDP before its group (else its destructor can hang at exit)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_two_ranks_equal_one_process(tmp_path, preset):
    """DDP and FSDP2 (one pair of ranks trains each in turn), each against the same one-process run."""
    normaliser = "token" if preset == "tiny-dense" else "sequence"
    torch.set_num_threads(1)
    single = build_model(preset, VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    # the same micro-batches as the two ranks together: the MoE router's balancing loss is per
    # micro-batch, so a different packing would be a different objective
    def both_ranks(seqs):
        return [b for rank in (0, 1) for b in shard_micro_batches(seqs, 96, rank, 2) if not is_filler(b)]

    single_record = {}
    single_losses = _train(single, _steps(), build_rl_loss("reinforce"), normaliser, both_ranks, record=single_record)
    out = str(tmp_path / "rank0.pt")
    run_ranks(_rank, (2, str(tmp_path / "store"), preset, normaliser, out))
    results = torch.load(out)
    assert set(results) == set(KINDS)
    expected = single.state_dict()
    for kind, result in results.items():
        assert result["losses"] == pytest.approx(single_losses, rel=1e-5), kind
        assert_same_gradients(result["record"], single_record)
        worst = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        # AdamW steps every weight by ~lr = 1e-3 whatever the gradient's size, so float-order noise
        # in a gradient shows up at ~1e-6 after 3 steps; a wrong normaliser or a missed rank's
        # gradient moves weights by ~1e-3. (At lr 1e-2 that noise flipped one MoE token's top-2
        # experts by step 3: routing is discrete.)
        assert worst < 1e-5, (kind, sorted(((result["state"][k] - expected[k]).abs().max().item(), k)
                                           for k in expected)[-3:])


def test_shards_are_balanced_by_tokens_and_equal_in_count():
    seqs = _steps()[0]
    shards = [shard_micro_batches(seqs, 64, rank, 3) for rank in range(3)]
    assert len({len(s) for s in shards}) == 1  # every rank runs as many micro-batches
    real = [[b for b in shard if not is_filler(b)] for shard in shards]
    loads = [sum(b.n_tokens for b in shard) for shard in real]
    assert sum(loads) == sum(b.n_tokens for b in pack(seqs, max(64, max(len(s.tokens) for s in seqs))))
    assert max(loads) - min(loads) <= max(b.n_tokens for shard in real for b in shard)
    # fillers carry no loss
    for shard, kept in zip(shards, real, strict=True):
        for filler in shard[len(kept):]:
            assert float(filler.token_weights.abs().sum()) == 0.0


def _packed(seqs: list[Sequence]) -> list[PackedBatch]:
    """A step's micro-batches as the flows pack them for 2 ranks."""
    return pack(seqs, balanced_budget(sum(len(s.tokens) for s in seqs), max(len(s.tokens) for s in seqs), 96, 2))


def _lead_or_follow(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file store, not a TCP port: nothing another process could take between pick and bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model = build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
        dp = data_parallel(model, "ddp", torch.device("cpu"))
        optimizer, loss_fn = build_optimizer(model, lr=1e-3), build_rl_loss("reinforce")
        if rank == 0:  # only rank 0 knows the data, as in a flow
            metrics = [lead_step(dp, optimizer, None, _packed(seqs), loss_fn, ONE_STEP) for seqs in _steps()]
            stop_followers(dp)
            torch.save({"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
                        "state": model.state_dict()}, out)
        else:  # DDP replicas hold whole tensors
            torch.save({"steps": follow(dp, optimizer, None, loss_fn), "state": model.state_dict()},
                       out + ".rank1")
    finally:
        dp = None  # DDP before its group (else its destructor can hang at exit)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank_zero_leads_and_the_others_follow(tmp_path):
    out = str(tmp_path / "lead.pt")
    run_ranks(_lead_or_follow, (2, str(tmp_path / "store"), out))
    lead, follower = torch.load(out), torch.load(out + ".rank1")
    assert follower["steps"] == STEPS
    single = build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0)

    def both_ranks(seqs):
        return [b for rank in (0, 1) for b in share_of(_packed(seqs), rank, 2) if not is_filler(b)]

    record = {}
    assert lead["losses"] == pytest.approx(_train(single, _steps(), build_rl_loss("reinforce"), "token", both_ranks,
                                                  record=record), rel=1e-5)
    assert lead["grad_norms"] == pytest.approx(record["grad_norms"], rel=1e-4)  # weights cannot see a scale
    for name, value in single.state_dict().items():  # replicas stay equal, and equal to one process
        assert torch.equal(lead["state"][name], follower["state"][name]), name
        assert (lead["state"][name] - value).abs().max().item() < 1e-5, name


def _restore_rank(rank: int, world: int, store: str, preset: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file store, not a TCP port: nothing another process could take between pick and bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        loss_fn, steps, cpu = build_rl_loss("reinforce"), _steps(), torch.device("cpu")

        def step(model, dp, optimizer, seqs):
            forward_backward(model, shard_micro_batches(seqs, 96, rank, world), loss_fn,
                             StepOptions(normaliser="sequence"), ranks=dp)
            optim_step(model, optimizer, None, max_grad_norm=1.0)

        model = build_model(preset, VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
        dp = data_parallel(model, "fsdp2", cpu)
        optimizer = build_optimizer(model, lr=1e-3)
        for seqs in steps[:2]:
            step(model, dp, optimizer, seqs)
        weights, state = full_model_state(model), full_optimizer_state(optimizer)
        # a resume: a fresh trainer gets rank 0's whole weights and optimizer state
        fresh = build_model(preset, VOCAB, seed=1, pad_token_id=0, eos_token_id=0)
        if rank == 0:
            fresh.load_state_dict(weights)
        broadcast_weights(fresh)
        fresh_dp = data_parallel(fresh, "fsdp2", cpu)
        fresh_optimizer = build_optimizer(fresh, lr=1e-3)
        load_full_optimizer_state(fresh_optimizer, state)
        step(model, dp, optimizer, steps[2])
        step(fresh, fresh_dp, fresh_optimizer, steps[2])
        continued, restored = full_model_state(model), full_model_state(fresh)
        if rank == 0:
            assert fresh_dp.view is not None and dp.view is not None
            torch.save({"weights": weights, "optimizer": state, "continued": continued, "restored": restored,
                        "view": dp.view.state_dict()}, out)
    finally:
        dp = fresh_dp = None  # DDP before its group (else its destructor can hang at exit)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_state_gathers_to_rank_0_and_restores_on_two_ranks_or_one(tmp_path):
    """The gathered whole state (what a checkpoint saves) resumes FSDP2 exactly, and also resumes
    a single process (another world size) to float-order noise."""
    out = str(tmp_path / "restore.pt")
    run_ranks(_restore_rank, (2, str(tmp_path / "store"), "tiny-moe", out))
    result = torch.load(out)
    for name, value in result["continued"].items():
        assert torch.equal(result["restored"][name], value), name
    # rank 0's view only follows the trainer through the flows' lead_step; here it is the start
    single = build_model("tiny-moe", VOCAB, seed=2, pad_token_id=0, eos_token_id=0)
    single.load_state_dict(result["weights"])
    optimizer = build_optimizer(single, lr=1e-3)
    optimizer.load_state_dict(result["optimizer"])  # the single-process format
    both = [b for rank in (0, 1) for b in shard_micro_batches(_steps()[2], 96, rank, 2) if not is_filler(b)]
    forward_backward(single, both, build_rl_loss("reinforce"), StepOptions(normaliser="sequence"))
    optim_step(single, optimizer, None, max_grad_norm=1.0)
    worst = max((single.state_dict()[k] - v).abs().max().item() for k, v in result["continued"].items())
    assert worst < 1e-5, worst
