"""The loss a phase trains with, as a value: None for next-token NLL (pretrain, SFT), a
`PolicyLoss` for RL (rl.loss and the off-policy mask around it). A value, not a closure, so it
crosses to every rank of a data-parallel run (tasks/ranks.py), where `phase_loss_fn` builds the
same function.

    loss_fn = phase_loss_fn(PolicyLoss(RLLossOptions(name="cispo"), off_policy=True))
"""

from __future__ import annotations

from rlpipe.training.loss_choice import PolicyLoss
from rlpipe.training.losses import LossFn, nll_loss
from rlpipe.training.off_policy import with_sequence_mask
from rlpipe.training.rl_loss import rl_loss_fn


def policy_loss_fn(loss: PolicyLoss) -> LossFn:
    """The loss function of a `PolicyLoss`."""
    loss_fn = rl_loss_fn(loss.options)
    if loss.off_policy or loss.sequence_mask > 0:
        loss_fn = with_sequence_mask(loss_fn, loss.sequence_mask)
    return loss_fn


def phase_loss_fn(loss: PolicyLoss | None) -> LossFn:
    """The loss function of a phase: NLL when `loss` is None, else its policy loss."""
    return nll_loss if loss is None else policy_loss_fn(loss)
