"""The loss a phase trains with: next-token NLL for pretrain/SFT, the configured policy loss for
RL. Built from the config on every rank (a closure does not cross processes: tasks/ranks.py).
"""

from __future__ import annotations


def loss_for(rl):
    """The policy loss of `rl.loss_options()` (async RL, k >= 1, gets truncated importance weights
    by default), with the sequence mask of rl.off_policy_sequence_mask and the mismatch metrics."""
    from rlpipe.training.off_policy import with_sequence_mask
    from rlpipe.training.rl_loss import rl_loss_fn

    loss_fn = rl_loss_fn(rl.loss_options())
    if rl.max_off_policy_steps > 0 or rl.off_policy_sequence_mask > 0:
        loss_fn = with_sequence_mask(loss_fn, rl.off_policy_sequence_mask)
    return loss_fn


def phase_loss(loss: tuple):
    """The loss of a phase named as ("nll",) (pretrain/SFT) or ("rl", RLConfig)."""
    if loss[0] == "nll":
        from rlpipe.training.losses import nll_loss

        return nll_loss
    return loss_for(loss[1])
