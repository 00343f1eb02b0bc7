"""A rank's own KL reference inputs (training/dist_reference.py), without a process group: the
single-process reference log-probs of its real micro-batches, fillers run but dropped, and a
step's PPO epochs served from the first epoch's figures."""

from __future__ import annotations

import torch
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.dist_reference import local_reference_inputs, place_reference
from rlpipe.training.distributed import DataParallel
from rlpipe.training.kl import frozen_copy, reference_logprobs
from rlpipe.training.loss_inputs import FILLER_ID
from rlpipe.training.step import StepOptions
from rlpipe.training.trainer import TrainOptions

VOCAB = 48


def _batches(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    seqs = [Sequence(tokens=torch.randint(1, VOCAB, (n,), generator=g).tolist(), weights=[1.0] * n,
                     sample_id=f"{seed}-{i}") for i, n in enumerate((9, 14, 5, 20))]
    return pack(seqs, token_budget=24)


def _counting(policy):
    calls = []
    original = policy.forward

    def forward(batch, **kwargs):
        calls.append(list(batch.sample_ids))
        return original(batch, **kwargs)

    policy.forward = forward
    return calls


def test_a_rank_scores_its_real_micro_batches_once_per_step():
    model = build_model("tiny-dense", VOCAB, seed=2)
    ref = build_model("tiny-dense", VOCAB, seed=2).train()
    reference = place_reference(ref, "ddp", torch.device("cpu"))
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    dp = DataParallel(module=None, kind="ddp", rank=0, world_size=1, reference=reference)
    calls = _counting(reference)
    filler = pack([Sequence(tokens=[0, 0], weights=[0.0, 0.0], sample_id=FILLER_ID)], 2)[0]
    mine = [*_batches(1), filler]
    options = TrainOptions(step=StepOptions(temperature=0.7, autocast=False, normaliser="token", entropy=True))
    real, inputs = local_reference_inputs(dp, mine, options)
    assert real == mine[:-1] and len(calls) == len(mine)  # the filler ran (FSDP2 lockstep), then dropped
    expected = reference_logprobs(frozen_copy(model), real, temperature=0.7)
    assert len(inputs["ref_logprobs"]) == len(real) > 1
    for got, want in zip(inputs["ref_logprobs"], expected, strict=True):
        torch.testing.assert_close(got, want)
    assert local_reference_inputs(dp, mine, options)[1] is inputs  # the step's next PPO epoch
    assert len(calls) == len(mine)
    other = _batches(2)
    local_reference_inputs(dp, other, options)  # the next step scores its own batches
    assert len(calls) == len(mine) + len(other)
