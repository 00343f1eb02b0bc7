"""Data parallelism for the functional train step: N ranks give the gradient of one process.

    dist_env = init_from_environment()                  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    dp = data_parallel(model, "ddp" | "fsdp2", device)  # build the optimizer after this (FSDP2 shards)
    mine = shard_micro_batches(sequences, token_budget, dp.rank, dp.world_size)
    forward_backward(model, mine, loss_fn, ranks=dp)
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
import copy
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from rlpipe.training.batch import PackedBatch, Sequence, pack
from rlpipe.training.dist_state import full_optimizer_state
from rlpipe.training.entropy import token_logprobs_and_entropy
from rlpipe.training.logprobs import token_logprobs
from rlpipe.training.loss_inputs import filler_batch, is_filler
from rlpipe.training.losses import Normaliser, batch_counts, normaliser_totals
from torch import nn

Parallel = Literal["none", "ddp", "fsdp2"]
class PackedPolicy(nn.Module):
    """`model`'s per-token log-probs of a PackedBatch as one module forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, temperature: float = 1.0, chunk_size: int = 1024, entropy: bool = False,
                head: str = "chunked"):
        """(logprobs [T], aux loss or None), plus the entropy [T] (no gradient) with `entropy`:
        inside the forward, where FSDP2 has gathered the LM head."""
        if entropy:
            return token_logprobs_and_entropy(self.model, batch, temperature=temperature, chunk_size=chunk_size,
                                              head=head)
        return token_logprobs(self.model, batch, temperature=temperature, chunk_size=chunk_size, head=head)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a torchrun-style launch."""

    rank: int
    world_size: int
    local_rank: int


def init_from_environment(device_type: str = "cpu", timeout_s: float = 1800.0) -> DistEnv:
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
        # a dead rank must fail the others' collectives, not hang them forever
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return env


@dataclass
class DataParallel:
    """The wrapped policy and how this rank takes part (see the module docstring).

    model: the trained module (its parameters sharded under FSDP2). view: rank 0's module with
    whole weights, which engines, evals and checkpoints read: the model itself under DDP, a
    copy refreshed after every step under FSDP2 (None on the other ranks)."""

    module: nn.Module
    kind: Parallel
    rank: int
    world_size: int
    model: nn.Module | None = None
    view: nn.Module | None = None
    reference: nn.Module | None = None  # the KL reference on this rank (training/dist_reference.py)
    reference_cache: tuple | None = None  # the last step's reference inputs, for its PPO epochs

    @property
    def grad_scale(self) -> float:
        """DDP and FSDP2 average gradients over ranks: each rank's loss is scaled back to a sum."""
        return float(self.world_size)

    def totals(self, batches, normaliser: Normaliser) -> dict[str, int]:
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

    def counts(self, batch: PackedBatch) -> dict[str, int]:
        """What one of this rank's micro-batches adds to the counts (a filler: nothing)."""
        counts = batch_counts(batch)
        return dict.fromkeys(counts, 0) if is_filler(batch) else counts

    def forward(self, model: nn.Module, batch: PackedBatch, *, temperature: float, chunk_size: int,
                entropy: bool, head: str = "chunked"):
        """The wrapped policy's (log-probs, aux loss or None, entropy or None) of `batch`: through
        the DDP/FSDP2 module's forward (`model` is the module it wraps)."""
        logprobs, aux, *rest = self.module(batch, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                                           head=head)
        return logprobs, aux, rest[0] if rest else None

    def reduce(self, loss_sum: float, aux_sum: float, fn_sums: dict[str, float], fn_weights: dict[str, float]):
        """The step's figures over every rank: losses summed, the aux loss averaged, loss_fn
        metrics as global loss-token-weighted sums."""
        return (self.sum(loss_sum), self.sum(aux_sum) / self.world_size, self.sum_by_key(fn_sums),
                self.sum_by_key(fn_weights))

    def sync(self, last: bool):
        """Gradients are reduced across ranks only on the step's last micro-batch."""
        if last:
            return contextlib.nullcontext()
        if self.kind == "ddp":
            return self.module.no_sync()
        return _fsdp_no_sync(self.module)

    def sum(self, value: float) -> float:
        """`value` summed over every rank."""
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor)

    def sum_by_key(self, values: dict[str, float]) -> dict[str, float]:
        """Every rank's `values` summed key by key (a key some rank lacks counts 0 there): a
        loss may add metrics only for some micro-batches, so key sets can differ by rank."""
        parts: list[dict[str, float]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(parts, values)
        out: dict[str, float] = {}
        for part in parts:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        return out


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
    rank = dist.get_rank()
    policy = PackedPolicy(model)
    view: nn.Module | None = model if rank == 0 else None
    if kind == "ddp":
        # "cuda" means this rank's GPU (init_from_environment set it from LOCAL_RANK)
        ids = [torch.cuda.current_device() if device.index is None else device.index] \
            if device.type == "cuda" else None
        module: nn.Module = nn.parallel.DistributedDataParallel(policy, device_ids=ids)
    else:
        if rank == 0:  # sharding replaces the parameters in place: keep whole ones for the engines
            view = copy.deepcopy(model)
        module = shard_policy(policy, device)
    return DataParallel(module=module, kind=kind, rank=rank, world_size=dist.get_world_size(),
                        model=model, view=view)


def shard_policy(policy: PackedPolicy, device: torch.device) -> nn.Module:
    """FSDP2 over a PackedPolicy: each decoder layer its own unit, then the rest (embeddings, final
    norm, LM head); bf16 compute with fp32 gradient reduction on CUDA."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for layer in policy.model.model.layers:
        fully_shard(layer, mp_policy=mp)
    return fully_shard(policy, mp_policy=mp)


class GatheredOptimizer:
    """Rank 0's optimizer as checkpoints see it: `state_dict()` is the whole state (gathered
    from every rank under FSDP2); everything else is the optimizer's own."""

    def __init__(self, dp: DataParallel, optimizer: torch.optim.Optimizer) -> None:
        self._dp, self._optimizer = dp, optimizer

    def state_dict(self) -> dict:
        if self._dp.kind == "ddp":  # replicas: rank 0 holds it all
            return self._optimizer.state_dict()
        dist.broadcast_object_list([("optimizer_state",)], src=0)
        return full_optimizer_state(self._optimizer)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def balanced_budget(n_tokens: int, longest: int, token_budget: int, world_size: int) -> int:
    """The micro-batch token budget that gives every rank work in a small step: at most
    `token_budget`, at least the longest sequence."""
    return max(longest, min(token_budget, -(-n_tokens // world_size)))


def share_of(batches: list[PackedBatch], rank: int, world_size: int) -> list[PackedBatch]:
    """This rank's packed micro-batches of a step, balanced by tokens (longest first to the least
    loaded rank; the same on every rank), padded with zero-weight fillers to one count."""
    loads = [0] * world_size
    mine_by_rank: list[list[PackedBatch]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(batches)), key=lambda i: (-batches[i].n_tokens, i)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += batches[index].n_tokens
        mine_by_rank[target].append(batches[index])
    count = max(1, max(len(m) for m in mine_by_rank))
    filler = filler_batch()
    return mine_by_rank[rank] + [filler] * (count - len(mine_by_rank[rank]))


def shard_micro_batches(
    sequences: list[Sequence], token_budget: int, rank: int, world_size: int
) -> list[PackedBatch]:
    """This rank's micro-batches of `sequences` (packed with `balanced_budget`, shared out by
    `share_of`)."""
    total = sum(len(s.tokens) for s in sequences)
    longest = max((len(s.tokens) for s in sequences), default=2)
    return share_of(pack(sequences, balanced_budget(total, longest, token_budget, world_size)), rank, world_size)
