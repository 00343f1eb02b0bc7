"""What choosing a loss decides, without torch: the policy losses' names and rules, their options
(`RLLossOptions`), the RL loss of a run as a value (`PolicyLoss`), the KL estimators' names, the
normalisers and LoRA's options. The config sections (training/config.py, rollouts/config.py)
validate against these, so a config error is reported before torch or transformers is imported;
the loss functions themselves are in training/rl_loss.py (`LOSSES` pairs each name here with its
function).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Normaliser = Literal["token", "sequence", "constant"]
KL_ESTIMATORS = ("k1", "k2", "k3")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LossRules:
    """Everything that choosing a policy loss decides, besides its function."""

    normaliser: Normaliser | None = None
    """The normaliser its objective is defined with; None: it follows rl.optim.normaliser."""
    tis: Literal["engine", "with_old_logprobs", "never"] = "never"
    """Truncated importance weights (tis_cap): against the engine's log-probs; only with the trainer's
    old log-probs (which a run does not bind: its ratio against the engine covers the mismatch); never
    (the loss weights tokens by its own importance ratio)."""
    std_scaling: bool = True
    """Whether the group's advantages may be divided by their std (rl.advantages.normalize_std)."""


LOSS_RULES: dict[str, LossRules] = {
    "reinforce": LossRules(tis="engine"),
    "ppo_clip": LossRules(tis="with_old_logprobs"),
    "gspo": LossRules(normaliser="sequence"),
    "cispo": LossRules(),
    "dr_grpo": LossRules(normaliser="constant", std_scaling=False),
}
"""The policy losses by name, in the order `rl.loss.type` lists them."""
LOSS_NAMES = tuple(LOSS_RULES)


@dataclass(frozen=True, kw_only=True)
class RLLossOptions:
    """Options of the policy loss (rl.loss.type, rl.loss.epsilon_low, ... in a run config)."""

    name: str = "reinforce"
    """Which loss (a key of `LOSS_RULES`)."""
    epsilon_low: float = 0.2
    """ppo_clip, gspo, dr_grpo: the ratio is clipped below at 1 − epsilon_low."""
    epsilon_high: float = 0.28
    """ppo_clip, gspo, dr_grpo: the ratio is clipped above at 1 + epsilon_high ('clip-higher')."""
    tis_cap: float = 0.0
    """Truncated importance weight cap C for engine/trainer mismatch (0 = off)."""
    cispo_cap: float = 5.0
    """cispo: the importance weight is truncated at this value (ε_max)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0 = off, no reference needed)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator (training/kl.py)."""

    def __post_init__(self) -> None:
        if self.name not in LOSS_RULES:
            raise ValueError(f"unknown RL loss {self.name!r}; known: {', '.join(LOSS_RULES)}")
        if not 0 <= self.epsilon_low < 1:
            raise ValueError(f"epsilon_low must be in [0, 1), got {self.epsilon_low}")
        if self.epsilon_high < 0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.tis_cap < 0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")
        if self.tis_cap > 0 and LOSS_RULES[self.name].tis == "never":
            with_tis = " and ".join(name for name, kind in LOSS_RULES.items() if kind.tis != "never")
            raise ValueError(f"rl.loss.tis_cap is for {with_tis}; rl.loss.type = {self.name!r} weights tokens by its "
                             "own importance ratio")
        if not self.cispo_cap > 0:
            raise ValueError(f"cispo_cap must be > 0, got {self.cispo_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0 (0 = off), got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def check_loss_choice(options: RLLossOptions, *, normalize_std: bool, normaliser: Normaliser | None) -> None:
    """Raise ValueError for what a run may not combine with its loss: truncated importance weights
    a run's ratio already covers, std-scaled advantages the loss removes, and a configured
    normaliser (`normaliser`, None when the config leaves it unset) other than the loss's own."""
    kind = LOSS_RULES[options.name]
    if options.tis_cap > 0 and kind.tis == "with_old_logprobs":
        raise ValueError(f"rl.loss.tis_cap with rl.loss.type = {options.name!r} is not supported: the PPO ratio "
                         "against the engine's log-probs already absorbs the mismatch")
    if normalize_std and not kind.std_scaling:
        raise ValueError(f"rl.loss.type = {options.name!r} removes the std normalisation: set rl.advantages.normalize_std = false")
    if kind.normaliser and normaliser is not None and normaliser != kind.normaliser:
        raise ValueError(f"rl.loss.type = {options.name!r} is normalised per {kind.normaliser}; rl.optim.normaliser = "
                         f"{normaliser!r} contradicts it (leave it unset)")


def loss_normaliser(name: str, configured: Normaliser | None, sequences_per_step: int,
                    max_new_tokens: int) -> tuple[Normaliser, float]:
    """(normaliser, constant) for loss `name`: its own (gspo: per sequence; dr_grpo: the constant
    sequences_per_step × max_new_tokens), else `configured`, else 'token'. The constant also serves a
    configured 'constant' normaliser: the most completion tokens a step can hold."""
    mode = LOSS_RULES[name].normaliser or configured or "token"
    return mode, float(sequences_per_step * max_new_tokens)


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """What `add_lora` injects. The run config's `model.lora` section is where a run's values
    come from (its `options()`: None when LoRA is off); the defaults here are that section's."""

    rank: int
    """Adapter rank r (>= 1; no default: an adapter's rank is always chosen)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) · B·A."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    """Names of the Linear modules that get adapters."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA needs alpha > 0 and dropout in [0, 1), got {self.alpha}, {self.dropout}")
        if not self.targets:
            raise ValueError("LoRA targets must name at least one module")


@dataclass(frozen=True)
class PolicyLoss:
    """The RL loss of a run: the policy loss's options and what wraps it for async RL."""

    options: RLLossOptions
    """The policy loss (rl.loss; an async run's truncated importance weights included)."""
    sequence_mask: float = 0.0
    """Mask whole sequences whose mean log-ratio exceeds this (rl.off_policy.sequence_mask; 0 = off)."""
    off_policy: bool = False
    """Batches may be sampled by older weights (rl.off_policy.max_steps >= 1): the loss reports
    the engine/trainer mismatch (training/off_policy.py)."""
