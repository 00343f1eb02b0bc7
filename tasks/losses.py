"""The loss a phase trains with: next-token NLL for pretrain/SFT, the configured policy loss for
RL. Built from the config on every rank (a closure does not cross processes: tasks/ranks.py).
"""

from __future__ import annotations


def loss_for(rl):
    """The policy loss; async RL (k >= 1) gets truncated importance weights by default, the
    sequence mask of rl.off_policy_sequence_mask, and the mismatch metrics."""
    from rlpipe.training.off_policy import with_sequence_mask
    from rlpipe.training.rl_loss import build_rl_loss

    tis_cap = rl.tis_cap
    if rl.max_off_policy_steps > 0 and tis_cap == 0 and rl.loss == "reinforce":
        tis_cap = rl.off_policy_tis_cap
    loss_fn = build_rl_loss(rl.loss, epsilon_low=rl.epsilon_low, epsilon_high=rl.epsilon_high, tis_cap=tis_cap,
                            cispo_cap=rl.cispo_cap, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator)
    if rl.max_off_policy_steps > 0 or rl.off_policy_sequence_mask > 0:
        loss_fn = with_sequence_mask(loss_fn, rl.off_policy_sequence_mask)
    return loss_fn


def phase_loss(loss: tuple):
    """The loss of a phase named as ("nll",) (pretrain/SFT) or ("rl", RLConfig)."""
    if loss[0] == "nll":
        from rlpipe.training.losses import nll_loss

        return nll_loss
    return loss_for(loss[1])
