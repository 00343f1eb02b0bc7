"""The KL reference under data parallelism: every rank scores the micro-batches it trains.

In one process the flow computes the reference policy's log-probs of a step's micro-batches
before training on them (training/kl.py). On N ranks, rank 0 doing that for everyone would run
N shares of reference forwards on one device while the others wait, and hold a whole extra copy
of the model there even under FSDP2. Instead every rank holds the reference, loaded with rank
0's reference weights once per phase (tasks/ranks.py) — a whole copy under DDP, where each rank
holds whole weights anyway; sharded like the trainer under FSDP2 — and scores its own share of
each step. The log-probs are the single-process ones: same function, same options, same batches.
"""

from __future__ import annotations

import torch
from rlpipe.models.loading import autocast_context
from rlpipe.training.batch import PackedBatch
from rlpipe.training.distributed import DataParallel, PackedPolicy, shard_policy
from rlpipe.training.loss_inputs import is_filler
from torch import nn


def place_reference(ref: nn.Module, kind: str, device: torch.device) -> nn.Module:
    """Every rank, once `ref` holds rank 0's reference weights: the module that scores
    micro-batches (frozen in place; under FSDP2 sharded per layer like the trainer)."""
    ref.eval()
    for param in ref.parameters():
        param.requires_grad_(False)
    policy = PackedPolicy(ref)
    return shard_policy(policy, device) if kind == "fsdp2" else policy


@torch.no_grad()
def local_reference_inputs(dp: DataParallel, mine: list[PackedBatch], options
                           ) -> tuple[list[PackedBatch], dict[str, list[torch.Tensor]]]:
    """This rank's micro-batches that carry loss (fillers dropped) and their reference log-probs
    (`ref_logprobs`, float32 [T] each on the CPU), as `with_batch_inputs` takes them.

    Fillers run through the reference too: under FSDP2 its forwards gather parameters with
    collectives, so every rank runs as many as the others. A step's PPO epochs reuse the first
    epoch's figures (`dp.reference_cache`). options: the step's TrainOptions (its step's autocast
    and temperature)."""
    keys = tuple(tuple(b.sample_ids) for b in mine)
    if dp.reference_cache is not None and dp.reference_cache[0] == keys:
        return dp.reference_cache[1]
    device = next(dp.reference.parameters()).device
    real, logprobs = [], []
    for batch in mine:
        with autocast_context(device, options.step.autocast):
            out, _ = dp.reference(batch.to(device), temperature=options.step.temperature)
        if not is_filler(batch):
            real.append(batch)
            logprobs.append(out.float().cpu())
    result = (real, {"ref_logprobs": logprobs})
    dp.reference_cache = (keys, result)
    return result
