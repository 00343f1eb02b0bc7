"""Data parallelism for the functional train step: N ranks give the gradient of one process.

    dist_env = init_from_environment()                  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    dp = data_parallel(model, "ddp" | "fsdp2", device)  # build the optimizer after this (FSDP2 shards)
    mine = shard_micro_batches(sequences, token_budget, dp.rank, dp.world_size)
    forward_backward(model, mine, loss_fn, data_parallel=dp)
    optim_step(model, optimizer, scheduler, max_grad_norm)

Exactness: every rank runs the same number of micro-batches (a rank with less work runs
zero-weight filler ones, so collectives line up); the normaliser's counts are summed over all
ranks before any loss is formed; DDP and FSDP2 average gradients over ranks, so each rank's
loss is scaled by the world size. The result is the single-process gradient up to the order of
floating-point sums.

Why a wrapper module (`PackedPolicy`): the step computes log-probs by running the decoder and a
chunked LM head itself, not through `model.forward`. DDP prepares its reducer, and FSDP2 gathers
and frees parameters, in the forward of the module they wrap, so that forward must be the whole
log-prob computation.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from training.batch import PackedBatch, Sequence, pack
from training.logprobs import token_logprobs
from training.losses import Normaliser, normaliser_totals

Parallel = Literal["none", "ddp", "fsdp2"]
FILLER_ID = "<filler>"
"""sample_id of the zero-weight micro-batch a rank runs when it has fewer than the others."""


def is_filler(batch: PackedBatch) -> bool:
    return list(batch.sample_ids) == [FILLER_ID]


class PackedPolicy(nn.Module):
    """`model`'s per-token log-probs of a PackedBatch as one module forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, temperature: float = 1.0, chunk_size: int = 1024):
        return token_logprobs(self.model, batch, temperature=temperature, chunk_size=chunk_size)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a torchrun-style launch."""

    rank: int
    world_size: int
    local_rank: int


def init_from_environment(device_type: str = "cpu") -> DistEnv:
    """Join the process group torchrun's variables describe (NCCL on CUDA, gloo on the CPU)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"not launched as a distributed rank: {', '.join(missing)} unset "
                         "(use `rlpipe run ... --nproc-per-node N` or torchrun)")
    env = DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
    return env


@dataclass
class DataParallel:
    """The wrapped policy and how this rank takes part (see the module docstring)."""

    module: nn.Module
    kind: Parallel
    rank: int
    world_size: int

    def global_totals(self, batches, normaliser: Normaliser) -> dict[str, int]:
        """The step's normaliser counts summed over every rank's micro-batches."""
        real = [b for b in batches if not is_filler(b)] or batches[:1]
        local = normaliser_totals(real, "constant")  # counts only; the check comes below
        if not any(not is_filler(b) for b in batches):
            local = dict.fromkeys(local, 0)
        keys = sorted(local)
        summed = torch.tensor([local[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(summed)
        totals = {k: int(v) for k, v in zip(keys, summed.tolist(), strict=True)}
        if normaliser != "constant" and totals["loss_tokens"] == 0:
            raise ValueError(f"normaliser {normaliser!r}: the step has no loss tokens on any rank")
        return totals

    def sync(self, last: bool):
        """Gradients are reduced across ranks only on the step's last micro-batch."""
        if last:
            return contextlib.nullcontext()
        if self.kind == "ddp":
            return self.module.no_sync()
        return _fsdp_no_sync(self.module)

    def sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor)


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def data_parallel(model: nn.Module, kind: Parallel, device: torch.device) -> DataParallel:
    """Wrap `model` for data parallelism over the default process group (model already on
    `device`). FSDP2 shards every decoder layer, then the rest; DDP replicates."""
    if kind not in ("ddp", "fsdp2"):
        raise ValueError(f"train.parallel must be 'ddp' or 'fsdp2' to wrap a model, got {kind!r}")
    policy = PackedPolicy(model)
    if kind == "ddp":
        ids = [device.index or 0] if device.type == "cuda" else None
        module: nn.Module = nn.parallel.DistributedDataParallel(policy, device_ids=ids)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if device.type == "cuda" else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        module = fully_shard(policy, mp_policy=mp)
    return DataParallel(module=module, kind=kind, rank=dist.get_rank(), world_size=dist.get_world_size())


def shard_micro_batches(
    sequences: list[Sequence], token_budget: int, rank: int, world_size: int
) -> list[PackedBatch]:
    """This rank's micro-batches of a step, balanced by tokens across ranks (the same on every
    rank: deterministic), padded with zero-weight fillers to the same count on every rank."""
    total = sum(len(s.tokens) for s in sequences)
    longest = max((len(s.tokens) for s in sequences), default=2)
    # small steps: smaller packs, so every rank gets work
    budget = max(longest, min(token_budget, -(-total // world_size)))
    batches = pack(sequences, budget)
    loads = [0] * world_size
    mine_by_rank: list[list[PackedBatch]] = [[] for _ in range(world_size)]
    for batch in sorted(batches, key=lambda b: -b.n_tokens):  # longest-processing-time first
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += batch.n_tokens
        mine_by_rank[target].append(batch)
    count = max(len(m) for m in mine_by_rank)
    filler = pack([Sequence(tokens=[0, 0], weights=[0.0, 0.0], sample_id=FILLER_ID)], 2)[0]
    return mine_by_rank[rank] + [filler] * (count - len(mine_by_rank[rank]))


# Rank 0 runs the flow (tables, MLflow, engines); the other ranks only train. Each optimizer
# step, rank 0 broadcasts the step's sequences and settings; every rank then takes its shard
# and runs the same step. The loss function is built on each rank from the shared config (a
# closure does not cross processes).


def lead_step(dp: DataParallel, model, optimizer, scheduler, sequences: list[Sequence], loss_fn,
              token_budget: int, max_grad_norm: float | None, **step_options) -> dict[str, float]:
    """Rank 0: send a step to the other ranks, take part in it, return its metrics."""
    dist.broadcast_object_list([("train", sequences, token_budget, max_grad_norm, step_options)], src=0)
    return _step(dp, model, optimizer, scheduler, sequences, loss_fn, token_budget, max_grad_norm, step_options)


def stop_followers(dp: DataParallel) -> None:
    """Rank 0: let the other ranks' `follow` return."""
    dist.broadcast_object_list([("stop",)], src=0)


def follow(dp: DataParallel, model, optimizer, scheduler, loss_fn) -> int:
    """Ranks > 0: run the steps rank 0 sends until it stops them; returns the steps run."""
    steps = 0
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0][0] == "stop":
            return steps
        _, sequences, token_budget, max_grad_norm, options = message[0]
        _step(dp, model, optimizer, scheduler, sequences, loss_fn, token_budget, max_grad_norm, options)
        steps += 1


def _step(dp, model, optimizer, scheduler, sequences, loss_fn, token_budget, max_grad_norm, options):
    from training.step import forward_backward, optim_step  # step imports this module

    mine = shard_micro_batches(sequences, token_budget, dp.rank, dp.world_size)
    metrics = forward_backward(model, mine, loss_fn, data_parallel=dp, **options)
    return metrics | optim_step(model, optimizer, scheduler, max_grad_norm)
