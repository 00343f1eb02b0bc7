"""Whole and sharded state across data-parallel ranks: weights broadcast from rank 0, rank 0's
whole-weight view refreshed from FSDP2 shards, optimizer state gathered to the single-process
format (checkpoints do not depend on the world size) and sharded back on load. Collectives:
every rank calls them together (training/distributed.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_weights(model: nn.Module) -> None:
    """Every rank's `model` gets rank 0's weights (before wrapping: rank 0 may have loaded a
    checkpoint, the others hold a fresh init)."""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor.data, src=0)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole weights on CPU on rank 0 (sharded ones gathered), {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def refresh_view(model: nn.Module, view: nn.Module | None) -> None:
    """Collective: rank 0's whole-weight `view` (None elsewhere) := the sharded `model`'s weights,
    gathered on the device one tensor at a time, with no round trip through host memory."""
    from torch.distributed.tensor import DTensor

    targets = view.state_dict() if view is not None else {}
    for name, value in model.state_dict().items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if view is not None:
            targets[name].copy_(whole)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """Collective: `optimizer.state_dict()` with whole tensors on CPU on rank 0 (the format a
    single process saves, so checkpoints do not depend on the world size), None elsewhere."""
    state = optimizer.state_dict()
    whole = {index: {key: _whole(value) for key, value in entry.items()}
             for index, entry in sorted(state["state"].items())}
    return {"state": whole, "param_groups": state["param_groups"]} if dist.get_rank() == 0 else None


def _whole(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    # a copy: the caller keeps it while the optimizer goes on stepping in place
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict | None) -> None:
    """Collective: load rank 0's whole `state` (from `full_optimizer_state` or a single-process
    checkpoint) into every rank's optimizer, sharded like each parameter."""
    message = [state]
    dist.broadcast_object_list(message, src=0)
    state = message[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError(f"optimizer state holds {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, the model has {len(params)}")
    local = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        local[index] = {key: _local(value, param) for key, value in entry.items()}
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})


def _local(value, param):
    """An optimizer state value for this rank: sharded like `param` (a copy: never shared with
    the caller's state, which another optimizer may hold)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not torch.is_tensor(value):
        return value
    if isinstance(param, DTensor) and value.dim() > 0:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value.to(param.device if value.dim() > 0 else value.device, copy=True)
