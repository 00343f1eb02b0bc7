"""The `[rl]` section: the RL phase's length and batch, and one sub-table per component.

    [rl]                steps, prompts_per_step, group_size, prompt_pool, eval_every, checkpoint_every
    [rl.sampling]       how completions are sampled (engines/base.py SamplingParams)
    [rl.buffer]         the sampling rounds and the group buffer with its batch maker
                        (rollouts/group_buffer.py, rollouts/batch_makers.py)
    [rl.filter]         what leaves a step before its advantages (rollouts/fates.py)
    [rl.scoring]        how rewards are taken (rollouts/scoring.py)
    [rl.advantages]     the advantage estimator (rollouts/advantages.py)
    [rl.curriculum]     which prompts a round samples (rollouts/curriculum.py)
    [rl.off_policy]     async RL's bounds and corrections (rollouts/source.py, training/off_policy.py)
    [rl.loss]           the policy loss (training/config.py LossConfig)
    [rl.optim]          the optimizer and token budget (training/config.py OptimConfig)

A key of the flat `[rl]` of earlier versions is refused with its new place (`MOVED`); a stored
run's config.json is read with its keys moved (tasks/config.py `read_run_config`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from rlpipe.core.config import Section, options_from
from rlpipe.training.config import LossConfig, OptimConfig
from rlpipe.training.loss_choice import (
    LOSS_RULES,
    Normaliser,
    PolicyLoss,
    RLLossOptions,
    check_loss_choice,
    loss_normaliser,
)


class SamplingConfig(Section):
    """`[rl.sampling]`: how completions are sampled."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the loss evaluates the same tempered policy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(16, ge=1)
    """Completion length limit, in the model's tokens (reasoning and answer together): a budget
    set for rlpipe's character tokenizer means far more text with a BPE tokenizer, and the
    reasoning block of a thinking model spends it first."""
    max_thinking_tokens: int = Field(0, ge=0)
    """Thinking budget (0 = none): once a completion has spent this many tokens inside its
    `<think>` block, the engine writes `</think>` as its next token and sampling goes on with
    the answer, as Qwen3's guide does by hand. The torch engine only (engine.type = "torch");
    needs a tokenizer with `<think>` and `</think>` tokens."""


class BufferConfig(Section):
    """`[rl.buffer]`: the sampling rounds that fill a step's batch, and what the group buffer
    keeps of the valid groups and how it takes a batch from them (rollouts/group_buffer.py,
    rollouts/batch_makers.py `GrpoBatchMaker`)."""

    oversample_factor: float = Field(1.0, ge=1)
    """Sample this many times the prompts needed; surplus valid groups carry to the next step."""
    max_attempts: int = Field(4, ge=1)
    """Sampling rounds per step before giving up on filling the batch."""
    partial_batches: bool = False
    """When max_attempts rounds cannot fill the batch (a policy that solves nearly every prompt),
    train on the valid groups found instead of failing the step."""
    max_staleness: int = Field(1, ge=0)
    """Carried-over groups older than this many policy versions are dropped."""
    batch_maker: str = ""
    """A user's batch maker "module:Class" in place of the built-in one ("" = built-in): the
    class is constructed with the buffer's options and answers add / create_batch / metadata /
    state_dict / load_state_dict (docs/DESIGN.md, "Write a batch maker")."""
    retention: Literal["latest", "all", "max_age"] = "latest"
    """Which valid groups wait for a later step: "latest" keeps only the newest policy version of
    each example (an older group is dropped as stale when a newer one arrives), "all" keeps every
    version; both drop groups more than max(max_staleness, rl.off_policy.max_steps) versions old.
    "max_age" keeps every version up to `max_age` versions old instead."""
    max_age: int = Field(1, ge=0)
    """retention = "max_age": most policy versions a held group may lag the version being
    trained (in place of max_staleness)."""
    sampling: Literal["oldest", "reservoir"] = "oldest"
    """How a batch is taken from the held groups: "oldest" first, or "reservoir": at most
    `reservoir_size` valid groups are held (a new one evicts a held one at random) and each batch
    is drawn from them at random, seeded by the run's `seed`; the generator's state is in the
    checkpoint, so a resumed run draws the same batches."""
    reservoir_size: int = Field(64, ge=1)
    """sampling = "reservoir": most valid groups held; at least rl.prompts_per_step. The
    reservoir holds groups with non-zero advantages only (it needs rl.filter.drop_zero_variance)."""

    @model_validator(mode="after")
    def _check(self) -> BufferConfig:
        module, _, cls = self.batch_maker.partition(":")
        if self.batch_maker and not (module and cls):
            raise ValueError(f"rl.buffer.batch_maker must be 'module:Class', got {self.batch_maker!r}")
        return self


class FilterConfig(Section):
    """`[rl.filter]`: groups and completions left out of a step before its advantages, each
    with its fate (rollouts/fates.py)."""

    drop_zero_variance: bool = True
    """Drop groups whose rewards all match (they carry no signal)."""
    drop_truncated: bool = False
    """Leave completions cut at rl.sampling.max_new_tokens out of their group (DAPO's overlong
    filtering); their fate is `truncated`. Off: they are trained like any other."""
    sample_filter: str = ""
    """A user filter "module:function", called as f(rollout, score) on every scored completion
    (rollouts.records): True keeps it; False or a reason string leaves it out of its group, with
    the fate `filtered` ("" = none)."""


class ScoringConfig(Section):
    """`[rl.scoring]`: how a sampling round's rewards are taken (rollouts/scoring.py)."""

    max_reward_error_fraction: float = Field(0.5, ge=0, le=1)
    """Fail the step once this share of reward calls raised."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong penalty: over the last N tokens before rl.sampling.max_new_tokens the
    reward ramps down by up to overlong_penalty (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """DAPO: the penalty at max_new_tokens (the ramp's depth)."""


class AdvantagesConfig(Section):
    """`[rl.advantages]`: the advantage estimator (rollouts/advantages.py)."""

    estimator: Literal["grpo", "rloo"] = "grpo"
    """Advantage estimator."""
    normalize_std: bool = False
    """GRPO: divide by the group's reward std."""
    positive_only: bool = False
    """Clamp advantages at 0 (learn from successes only)."""


class CurriculumConfig(Section):
    """`[rl.curriculum]`: which prompts a sampling round samples (rollouts/curriculum.py)."""

    type: Literal["none", "pass_rate"] = "none"
    """"pass_rate" rests prompts whose last `window` completions all passed (solved) or all
    failed (hopeless), skipping them except for re-tests; every skip and re-test is a row of the
    `curriculum` table. "none": the prompt stream as it comes."""
    window: int = Field(8, ge=1)
    """pass_rate: a prompt's newest scored completions its pass rate is taken over; it rests only
    once this many are counted."""
    retest: float = Field(0.1, gt=0, le=1)
    """pass_rate: the chance that a resting prompt is sampled (re-tested) when the prompt stream
    reaches it; it is skipped otherwise (so it rests about 1/retest of its turns)."""
    pass_reward: float = 1.0
    """pass_rate: a completion passes when its reward is at least this."""
    key: Literal["example", "class"] = "example"
    """pass_rate: keep the pass history per prompt ("example") or per the environment's prompt
    class ("class": Example.curriculum_key, e.g. arithmetic's digits and carries; a prompt of an
    environment without classes is its own class), so prompts that never repeat rest with their
    solved class. With "class", make `window` span several groups."""
    reads: float = Field(0.0, ge=0)
    """pass_rate: a sampling round reads at most this many times the prompts it asks for from the
    stream (0 = until it has them): when most prompts rest, a round samples fewer prompts (the
    step fills with later rounds or trains a partial batch) instead of reading on for awake ones."""
    solved_rate: float = Field(1.0, gt=0.5, le=1)
    """pass_rate: a full window rests as solved when at least this share of it passed, hopeless
    when at most 1 - this share (1 = all passed / none passed)."""


class OffPolicyConfig(Section):
    """`[rl.off_policy]`: async RL, where rollouts of the next steps are sampled while a step
    trains (rollouts/source.py, docs/ASYNC.md), and the loss's corrections for it."""

    max_steps: int = Field(0, ge=0)
    """Rollouts of the next k steps are generated while the current step trains (0 = synchronous,
    on-policy). A trained sample lags the updated weights by at most max(k, rl.buffer.max_staleness)
    policy versions; older ones are dropped as stale."""
    partial_rollouts: bool = False
    """With the in-process engine: a weight update does not wait for the generation in flight;
    it lands between two decode steps and unfinished completions go on with the new weights,
    each token recording the version that sampled it (docs/ASYNC.md). Needs max_steps >= 1."""
    tis_cap: float = Field(2.0, ge=0)
    """Off-policy correction when max_steps >= 1 and rl.loss.tis_cap is 0: truncated importance
    weights capped at this value (0 = no correction)."""
    sequence_mask: float = Field(0.0, ge=0)
    """Mask whole sequences whose mean per-token log-ratio (trainer vs. the policy that sampled
    them) exceeds this in absolute value (0 = off; training/off_policy.py)."""


class DistillConfig(Section):
    """`[rl.distill]`: on-policy distillation from `rl.teacher` (rollouts/distill.py)."""

    type: Literal["none", "advantage", "reward"] = "none"
    """none | advantage: the teacher's per-token reverse KL, log p_teacher − log p_student, is the
    whole advantage (pure distillation) | reward: it is added, times `weight`, to each token's
    advantage from the verifier's reward."""
    weight: float = Field(1.0, gt=0)
    """With type = "reward": the weight of the teacher's per-token term."""
    url: str = ""
    """The teacher served over HTTP instead of in process: an OpenAI-compatible server that
    returns vLLM's `prompt_logprobs` (`rlpipe serve`: http://HOST:PORT; vLLM:
    vllm+http://HOST:PORT; engines/http_teacher.py). Its tokenizer must be the student's
    (checked before the run starts). rl.teacher then only names it in lineage (may be "")."""
    api_token_env: str = "RLPIPE_API_TOKEN"
    """With url: the environment variable holding the teacher server's bearer token (unset = none)."""
    timeout_s: float = Field(120.0, gt=0)
    """With url: seconds one scoring request may take."""
    retries: int = Field(3, ge=0)
    """With url: extra attempts when the server cannot be reached (then the run stops, naming it)."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value:
            from rlpipe.engines.http import parse_engine_url

            parse_engine_url(value)  # ValueError naming the url
        return value


MOVED: dict[str, str] = {
    # keys that became tables first: their old value is the new table's `type`
    "rl.loss": "rl.loss.type",
    "rl.curriculum": "rl.curriculum.type",
    **{f"rl.{key}": f"rl.buffer.{key}" for key in
       ("oversample_factor", "max_attempts", "partial_batches", "max_staleness", "batch_maker")},
    **{f"rl.{key}": f"rl.filter.{key}" for key in ("drop_zero_variance", "drop_truncated", "sample_filter")},
    **{f"rl.{key}": f"rl.scoring.{key}" for key in
       ("max_reward_error_fraction", "overlong_buffer", "overlong_penalty")},
    **{f"rl.{key}": f"rl.advantages.{key}" for key in ("estimator", "normalize_std", "positive_only")},
    **{f"rl.{key}": f"rl.loss.{key}" for key in
       ("epsilon_low", "epsilon_high", "cispo_cap", "kl_coef", "kl_estimator", "tis_cap", "ppo_epochs")},
    "rl.max_off_policy_steps": "rl.off_policy.max_steps",
    "rl.partial_rollouts": "rl.off_policy.partial_rollouts",
    "rl.off_policy_tis_cap": "rl.off_policy.tis_cap",
    "rl.off_policy_sequence_mask": "rl.off_policy.sequence_mask",
    **{f"rl.curriculum_{key}": f"rl.curriculum.{key}" for key in
       ("window", "retest", "pass_reward", "key", "solved_rate", "reads")},
}
"""Every key of the flat `[rl]` of earlier versions and its place now."""


class RLConfig(Section):
    """`[rl]`: the RL phase: its length and batch, and a sub-table per component."""

    steps: int = Field(50, ge=0)
    """Optimizer steps of RL."""
    prompts_per_step: int = Field(16, ge=1)
    """Groups (prompts) trained on per step."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt."""
    prompt_pool: int = Field(0, ge=0)
    """RL samples its prompts from the first N examples of the train split only (0 = all of
    them): a pool small enough that prompts come back, which the curriculum needs."""
    eval_every: int = Field(10, ge=0)
    """Greedy evaluation every N steps (and at step 0 and the end; 0 = only those)."""
    checkpoint_every: int = Field(10, ge=0)
    """Checkpoint every N steps (and the last; 0 = only the last)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling ([rl.sampling])."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """Sampling rounds and the group buffer ([rl.buffer])."""
    filter: FilterConfig = Field(default_factory=FilterConfig)
    """Groups and completions left out ([rl.filter])."""
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    """Reward errors and DAPO's overlong penalty ([rl.scoring])."""
    advantages: AdvantagesConfig = Field(default_factory=AdvantagesConfig)
    """The advantage estimator ([rl.advantages])."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """The prompt curriculum ([rl.curriculum])."""
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Async RL ([rl.off_policy])."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss ([rl.loss])."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=5))
    """Optimizer and batching ([rl.optim])."""
    teacher: str = ""
    """On-policy distillation: the teacher that scores every sampled token, a checkpoint folder, a
    registered version `models:/NAME@alias` (or `models:/NAME/VERSION`) or a hub id ORG/NAME[@REVISION];
    its tokenizer must be the student's. It runs on an engine of its own, in process, or on a
    server (rl.distill.url; this is then only its name in lineage). "": none."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """How the teacher's signal enters the advantage ([rl.distill])."""

    def loss_options(self) -> RLLossOptions:
        """The policy loss's options (training/rl_loss.py; building them validates them). Async RL
        (off_policy.max_steps >= 1) gives a loss that weights by the engine's log-probs truncated
        importance weights capped at off_policy.tis_cap when loss.tis_cap is 0."""
        tis_cap = self.loss.tis_cap
        if self.off_policy.max_steps > 0 and tis_cap == 0 and LOSS_RULES[self.loss.type].tis == "engine":
            tis_cap = self.off_policy.tis_cap
        return options_from(RLLossOptions, self.loss, name=self.loss.type, tis_cap=tis_cap)

    def policy_loss(self) -> PolicyLoss:
        """The RL loss as a value (training/policy_loss.py), the same on every rank."""
        return PolicyLoss(self.loss_options(), sequence_mask=self.off_policy.sequence_mask,
                          off_policy=self.off_policy.max_steps > 0)

    def loss_normaliser(self) -> tuple[Normaliser, float]:
        """(normaliser, constant) of the optimizer step: the loss's own (gspo: per sequence; dr_grpo:
        a constant) or optim.normaliser; the constant is the most completion tokens a step holds."""
        return loss_normaliser(self.loss.type, self.optim.normaliser, self.prompts_per_step * self.group_size,
                               self.sampling.max_new_tokens)

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        check_loss_choice(self.loss_options(), normalize_std=self.advantages.normalize_std,
                          normaliser=self.optim.normaliser)
        if self.scoring.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(f"rl.scoring.overlong_buffer ({self.scoring.overlong_buffer}) exceeds "
                             f"rl.sampling.max_new_tokens ({self.sampling.max_new_tokens})")
        if self.off_policy.max_steps > 0 and self.loss.ppo_epochs > 1:
            raise ValueError("rl.off_policy.max_steps >= 1 needs rl.loss.ppo_epochs = 1 (policy versions then "
                             "count steps, which the staleness bound is stated in)")
        if self.buffer.sampling == "reservoir" and self.buffer.reservoir_size < self.prompts_per_step:
            raise ValueError(f"rl.buffer.reservoir_size ({self.buffer.reservoir_size}) is smaller than "
                             f"rl.prompts_per_step ({self.prompts_per_step}): the reservoir could never fill a batch")
        if self.buffer.sampling == "reservoir" and not self.filter.drop_zero_variance:
            raise ValueError("rl.buffer.sampling = 'reservoir' holds groups with non-zero advantages: it needs "
                             "rl.filter.drop_zero_variance = true")
        if bool(self.teacher or self.distill.url) != (self.distill.type != "none"):
            raise ValueError("on-policy distillation needs both a teacher (rl.teacher, or rl.distill.url) and "
                             f"rl.distill.type (advantage | reward); got teacher = {self.teacher!r}, "
                             f"distill.url = {self.distill.url!r}, distill.type = {self.distill.type!r}")
        if self.distill.type == "advantage" and self.filter.drop_zero_variance:
            raise ValueError("rl.distill.type = 'advantage' trains every group, whatever its rewards: it needs "
                             "rl.filter.drop_zero_variance = false")
        if self.off_policy.partial_rollouts and self.off_policy.max_steps == 0:
            raise ValueError("rl.off_policy.partial_rollouts needs rl.off_policy.max_steps >= 1 (synchronous RL "
                             "samples nothing while the weights change)")
        return self
