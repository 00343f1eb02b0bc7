"""The config sections of what trains: the model and its LoRA adapters (`[model]`), the trainer
(`[train]`), optimizers (`optim` of each phase), the supervised phases (`[pretrain]`, `[sft]`) and
RL (`[rl]`, with its `[rl.sampling]`).

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes them into a run's
`RunConfig`. The policy loss's choices are checked by its registry (training/rl_loss.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from rlpipe.core.config import Section
from rlpipe.training.kl import KL_ESTIMATORS
from rlpipe.training.lora import DEFAULT_TARGETS, LoraOptions
from rlpipe.training.losses import Normaliser
from rlpipe.training.rl_loss import (
    LOSS_NAMES,
    LOSSES,
    RLLossOptions,
    check_loss_choice,
    loss_normaliser,
)


class LoraSection(Section):
    """`[model.lora]`: low-rank adapters instead of training every weight."""

    rank: int = Field(0, ge=0)
    """LoRA adapter rank (0 = off: every weight trains). Needs the `lora` extra (peft). Works
    under train.parallel (ddp and fsdp2): every rank injects the same adapters."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the update is alpha / rank x B.A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    targets: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear modules that get adapters."""

    def options(self) -> LoraOptions | None:
        """What `training.lora.add_lora` injects; None when rank is 0 (LoRA off)."""
        if self.rank == 0:
            return None
        return LoraOptions(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=tuple(self.targets))


class ModelConfig(Section):
    """`[model]`: the model to train, where it starts and its dtypes."""

    preset: str = "tiny-dense"
    """Named model preset (models/presets.py) used when `path` is empty."""
    path: str = ""
    """A Hugging Face checkpoint to start from instead of a preset: a local folder, or a hub id
    ORG/NAME[@REVISION] downloaded into the Hugging Face cache (HF_HOME, HF_TOKEN; HF_HUB_OFFLINE=1
    reads the cache only). Its own tokenizer and chat template are used."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Config fields to change on the preset (hidden_size, num_hidden_layers, ...)."""
    bf16_autocast: bool = True
    """Train under bf16 autocast where the device supports it (CUDA, or a CPU with AMX/AVX512-BF16):
    fp32 master weights and optimizer state, bf16 matmuls. On CUDA the engine samples in bf16 too."""
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights and optimizer state. bfloat16 = pure bf16 (half the memory, no fp32
    master copy; small updates can round away); float32 is the default (with bf16_autocast)."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA: train low-rank adapters only; checkpoints hold merged weights plus a PEFT adapter/."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables of the chat template, given to every rendering of a chat: SFT sequences,
    RL and eval prompts, multi-turn episodes and reward-model judges (unless a judge sets its
    own), so training and sampling see the same text. Qwen3: `{ enable_thinking = false }` puts
    the empty `<think>\n\n</think>\n\n` into the generation prompt (SFT then trains the answer
    after it, never the empty block); thinking on (Qwen3's default) makes the model write its
    reasoning block first."""


class CheckpointConfig(Section):
    """`[checkpoint]`: which of a run's checkpoints stay on disk (training/checkpoint_retention.py)."""

    keep_last: int = Field(0, ge=0)
    """Keep the newest N checkpoints of each phase and remove older ones as the run goes (0 = keep
    every checkpoint). Never removed: a checkpoint the registry's `best` alias points to, the
    newest (what a resume starts from; MLflow's `@latest`). Optimizer state is kept in the newest
    checkpoint only. A removed checkpoint's registered version stays, tagged `rlpipe.weights_removed`,
    its artifact copy deleted. The default keeps everything: removing weights cannot be undone, and
    a run's steps and evals stay replayable from any checkpoint until the user chooses a bound."""


class TrainConfig(Section):
    """`[train]`: how the trainer runs, shared by every phase."""

    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them:
    much less memory for long packs, about a third more compute."""
    compile: bool | None = None
    """torch.compile each decoder layer of the trained model (one shared graph, dynamic lengths;
    on CUDA the varlen attention inside it, on the CPU left eager) and, on CUDA, the chunked
    log-softmax kernels: fuses the norms, rotary, SwiGLU, autocast casts and vocabulary passes that
    dominate an eager GPU train step (2.4x faster steps on an H100, docs/BENCHMARKS_GPU.md).
    Unset (null, the default) = auto: on where the model trains on CUDA, off on the CPU (where
    the compile costs tens of seconds for ~1.2x) and off with activation_checkpointing. The run
    resolves it before it starts: config.json and the MLflow params hold true or false, and the
    first compiled step logs its compile seconds once (`perf/compile_seconds`; models/compile.py).
    true with activation_checkpointing is an error."""
    fused: Literal["auto", "liger", "none"] = "auto"
    """Fused kernels of the trained model (training/fused.py): "liger" patches Qwen3's RMSNorm,
    rotary and SwiGLU with Liger Kernel's Triton kernels (needs CUDA and the `liger` extra:
    pip install 'rlpipe[liger]'; an error where either is missing); "auto" does so where both are
    present and the model is a Qwen3, else runs the model as is; "none" never patches. The
    log-probs over the vocabulary always run rlpipe's chunked linear + log-softmax
    (training/logprobs.py), which never holds the [tokens, vocab] logits."""
    parallel: Literal["none", "ddp", "fsdp2"] = "none"
    """Data parallelism over the ranks of `rlpipe run --nproc-per-node N` (or torchrun): ddp
    replicates the model, fsdp2 shards it per transformer block (bf16 params, fp32 gradient
    reduction on CUDA). NCCL on CUDA, gloo on CPU. Rank 0 runs the flow, tables, MLflow and
    engines (not engine.type = "vllm": use vLLM servers); the other ranks only train. "none" with
    --nproc-per-node means ddp. rl.kl_coef, model.lora and the entropy metric work under both
    (docs/ARCHITECTURE.md, ranks)."""
    parallel_timeout_s: float = Field(1800.0, gt=0)
    """Seconds a rank waits in a collective before failing: the other ranks wait while rank 0
    generates, scores, evaluates and checkpoints, so it must exceed the longest of those."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.compile and self.activation_checkpointing:
            raise ValueError("train.compile with train.activation_checkpointing is not supported: the "
                             "checkpointed layers would run uncompiled (models/compile.py); turn one off")
        return self


class OptimConfig(Section):
    """`optim` of a phase: the optimizer, its schedule and the micro-batch size."""

    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (not applied to norms and biases)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup steps before the cosine decay."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the cosine decay as a fraction of lr."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold."""
    token_budget: int = Field(4096, ge=16)
    """Tokens per packed micro-batch (gradients are accumulated over micro-batches)."""
    normaliser: Literal["token", "sequence", "constant"] | None = None
    """Loss normaliser over the whole optimizer step; unset (null in config.json): RL takes its
    loss's own (gspo: sequence, dr_grpo: constant), everything else 'token'. Unset is a value of
    its own, so a resolved config validates again to the same config."""


class SftSource(Section):
    """One `[[sft.data]]` source of an SFT data mixture: where its conversations come from and
    its share of the phase's `examples`."""

    path: str
    """A .jsonl/.json/.parquet file, a folder (`datasets` save_to_disk, or data files) or
    `hf:NAME[:CONFIG]` (a hub dataset), as the dataset environment reads them (envs/dataset.py)."""
    split: str = "train"
    """Split of a folder or hub dataset."""
    revision: str = ""
    """Hub dataset revision; empty = the default branch."""
    weight: float = Field(1.0, gt=0)
    """Share of the mixture: this source gives weight / (sum of weights) of `examples`."""
    messages_column: str = "messages"
    """Column holding a whole chat (a list of {"role", "content"}), used when prompt_column is empty."""
    prompt_column: str = ""
    """Column of the user turn; with response_column, each row is one user/assistant exchange."""
    response_column: str = ""
    """Column of the assistant turn (the trained tokens) when prompt_column is set."""
    system_prompt: str = ""
    """A system turn put before each conversation of this source; empty = none."""

    @model_validator(mode="after")
    def _columns(self) -> SftSource:
        if bool(self.prompt_column) != bool(self.response_column):
            raise ValueError("an sft.data source sets prompt_column and response_column together (or neither, "
                             "to read messages_column)")
        return self


class SupervisedConfig(Section):
    """`[pretrain]` and `[sft]`: a supervised phase."""

    steps: int = Field(100, ge=0)
    """Optimizer steps."""
    sequences_per_step: int = Field(64, ge=1)
    """Sequences per optimizer step."""
    examples: int = Field(20000, ge=1)
    """Training examples drawn from the task (SFT) or documents (pretrain)."""
    data_path: str = ""
    """Pretrain: a text or JSONL file of documents; SFT: a JSONL of chat conversations.
    Empty = build from the task's environment (or, SFT, from `data`)."""
    data: list[SftSource] = Field(default_factory=list)
    """SFT only: a mixture of sources ([[sft.data]]), `examples` conversations drawn from them in
    proportion to their weights, the same ones in the same order for the same seed (a resumed run
    trains each step on what it would have). Not with data_path."""
    seq_len: int = Field(256, ge=8)
    """Pretrain: document chunk length in tokens."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and batching."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N steps (0 = only at the end)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only the last)."""

    @model_validator(mode="after")
    def _normaliser(self) -> SupervisedConfig:
        if self.data and self.data_path:
            raise ValueError("data_path and data (a mixture) are both set: put the file in data as one more source")
        if self.optim.normaliser == "constant":
            raise ValueError("optim.normaliser = 'constant' divides by the most completion tokens an RL step "
                             "holds, which a supervised phase does not have: use 'token' or 'sequence'")
        return self


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
    """`[rl.buffer]`: what the built-in batch maker keeps of the valid groups and how it takes a
    step's batch from them (rollouts/batch_makers.py `GrpoBatchMaker`)."""

    retention: Literal["latest", "all", "max_age"] = "latest"
    """Which valid groups wait for a later step: "latest" keeps only the newest policy version of
    each example (an older group is dropped as stale when a newer one arrives), "all" keeps every
    version; both drop groups more than max(rl.max_staleness, rl.max_off_policy_steps) versions
    old. "max_age" keeps every version up to `max_age` versions old instead."""
    max_age: int = Field(1, ge=0)
    """retention = "max_age": most policy versions a held group may lag the version being
    trained (in place of rl.max_staleness)."""
    sampling: Literal["oldest", "reservoir"] = "oldest"
    """How a batch is taken from the held groups: "oldest" first, or "reservoir": at most
    `reservoir_size` valid groups are held (a new one evicts a held one at random) and each batch
    is drawn from them at random, seeded by the run's `seed`; the generator's state is in the
    checkpoint, so a resumed run draws the same batches."""
    reservoir_size: int = Field(64, ge=1)
    """sampling = "reservoir": most valid groups held; at least rl.prompts_per_step. The
    reservoir holds groups with non-zero advantages only (it needs rl.drop_zero_variance)."""


class RLConfig(Section):
    """`[rl]`: the RL phase: batches, groups, advantages, the policy loss and off-policy bounds."""

    steps: int = Field(50, ge=0)
    """Optimizer steps of RL."""
    prompts_per_step: int = Field(16, ge=1)
    """Groups (prompts) trained on per step."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt."""
    oversample_factor: float = Field(1.0, ge=1)
    """Sample this many times the prompts needed; surplus valid groups carry to the next step."""
    max_attempts: int = Field(4, ge=1)
    """Sampling rounds per step before giving up on filling the batch."""
    partial_batches: bool = False
    """When max_attempts rounds cannot fill the batch (a policy that solves nearly every prompt),
    train on the valid groups found instead of failing the step."""
    max_staleness: int = Field(1, ge=0)
    """Carried-over groups older than this many policy versions are dropped."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The built-in batch maker's retention and sampling ([rl.buffer])."""
    batch_maker: str = ""
    """A user's batch maker "module:Class" in place of the built-in one ("" = built-in): the
    class is constructed with the buffer's options and answers add / create_batch / metadata /
    state_dict / load_state_dict (docs/DESIGN.md, "Write a batch maker")."""
    max_off_policy_steps: int = Field(0, ge=0)
    """Async RL: rollouts of the next k steps are generated while the current step trains
    (0 = synchronous, on-policy). A trained sample lags the updated weights by at most
    max(k, max_staleness) policy versions; older ones are dropped as stale."""
    partial_rollouts: bool = False
    """Async RL with the in-process engine: a weight update does not wait for the generation in
    flight; it lands between two decode steps and unfinished completions go on with the new
    weights, each token recording the version that sampled it (docs/ASYNC.md). Needs
    max_off_policy_steps >= 1."""
    off_policy_tis_cap: float = Field(2.0, ge=0)
    """Off-policy correction when max_off_policy_steps >= 1 and tis_cap is 0: truncated
    importance weights capped at this value (0 = no correction)."""
    off_policy_sequence_mask: float = Field(0.0, ge=0)
    """Mask whole sequences whose mean per-token log-ratio (trainer vs. the policy that sampled
    them) exceeds this in absolute value (0 = off; training/off_policy.py)."""
    estimator: Literal["grpo", "rloo"] = "grpo"
    """Advantage estimator."""
    normalize_std: bool = False
    """GRPO: divide by the group's reward std."""
    positive_only: bool = False
    """Clamp advantages at 0 (learn from successes only)."""
    drop_zero_variance: bool = True
    """Drop groups whose rewards all match (they carry no signal)."""
    drop_truncated: bool = False
    """Leave completions cut at sampling.max_new_tokens out of their group (DAPO's overlong
    filtering); their fate is `truncated`. Off: they are trained like any other."""
    sample_filter: str = ""
    """A user filter "module:function", called as f(rollout, score) on every scored completion
    (rollouts.records): True keeps it; False or a reason string leaves it out of its group, with
    the fate `filtered` ("" = none)."""
    loss: Literal[LOSS_NAMES] = "reinforce"
    """Policy loss (training/rl_loss.py): on-policy REINFORCE; PPO clipped token ratio against the
    engine's log-probs; GSPO sequence ratio (normalised per sequence); CISPO clipped, detached IS
    weight; Dr. GRPO (PPO clip normalised by prompts_per_step x group_size x max_new_tokens, no
    std scaling)."""
    epsilon_low: float = Field(0.2, ge=0, lt=1)
    """ppo_clip / gspo / dr_grpo: clip below 1; below 1 so the ratio's floor stays positive (the
    GSPO paper uses 3e-4)."""
    epsilon_high: float = Field(0.28, ge=0)
    """ppo_clip / gspo / dr_grpo: clip above 1, asymmetric (the GSPO paper uses 4e-4)."""
    cispo_cap: float = Field(5.0, gt=0)
    """cispo: truncate the importance weight at this value (epsilon_max)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the starting policy (a frozen copy kept in memory; 0 = off).
    Under train.parallel every rank holds the copy (sharded like the trainer under fsdp2) and
    computes the reference log-probs of the micro-batches it trains (training/dist_reference.py)."""
    kl_estimator: Literal[KL_ESTIMATORS] = "k3"
    """Per-token KL estimator: k1 = log ratio, k2 = squared / 2, k3 = exp(r) - r - 1 (TRL's)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong penalty: over the last N tokens before sampling.max_new_tokens the
    reward ramps down by up to overlong_penalty (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """DAPO: the penalty at max_new_tokens (the ramp's depth)."""
    ppo_epochs: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (PPO)."""
    tis_cap: float = Field(0.0, ge=0)
    """Truncated importance weight cap for engine/trainer mismatch (0 = off)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4, warmup_steps=5))
    """Optimizer and batching."""
    eval_every: int = Field(10, ge=0)
    """Greedy evaluation every N steps (and at step 0 and the end; 0 = only those)."""
    checkpoint_every: int = Field(10, ge=0)
    """Checkpoint every N steps (and the last; 0 = only the last)."""
    max_reward_error_fraction: float = Field(0.5, ge=0, le=1)
    """Fail the step once this share of reward calls raised."""
    prompt_pool: int = Field(0, ge=0)
    """RL samples its prompts from the first N examples of the train split only (0 = all of
    them): a pool small enough that prompts come back, which the curriculum needs."""
    curriculum: Literal["none", "pass_rate"] = "none"
    """Prompt selection (rollouts/curriculum.py): "pass_rate" rests prompts whose last
    curriculum_window completions all passed (solved) or all failed (hopeless), skipping them
    except for re-tests; every skip and re-test is a row of the `curriculum` table."""
    curriculum_window: int = Field(8, ge=1)
    """pass_rate: a prompt's newest scored completions its pass rate is taken over; it rests only
    once this many are counted."""
    curriculum_retest: float = Field(0.1, gt=0, le=1)
    """pass_rate: the chance that a resting prompt is sampled (re-tested) when the prompt stream
    reaches it; it is skipped otherwise (so it rests about 1/curriculum_retest of its turns)."""
    curriculum_pass_reward: float = 1.0
    """pass_rate: a completion passes when its reward is at least this."""
    curriculum_key: Literal["example", "class"] = "example"
    """pass_rate: keep the pass history per prompt ("example") or per the environment's prompt
    class ("class": Example.curriculum_key, e.g. arithmetic's digits and carries; a prompt of an
    environment without classes is its own class), so prompts that never repeat rest with their
    solved class. With "class", make curriculum_window span several groups."""
    curriculum_reads: float = Field(0.0, ge=0)
    """pass_rate: a sampling round reads at most this many times the prompts it asks for from the
    stream (0 = until it has them): when most prompts rest, a round samples fewer prompts (the
    step fills with later rounds or trains a partial batch) instead of reading on for awake ones."""
    curriculum_solved_rate: float = Field(1.0, gt=0.5, le=1)
    """pass_rate: a full window rests as solved when at least this share of it passed, hopeless
    when at most 1 - this share (1 = all passed / none passed)."""

    def loss_options(self) -> RLLossOptions:
        """The policy loss's options (training/rl_loss.py; building them validates them). Async RL
        (max_off_policy_steps >= 1) gives a loss that weights by the engine's log-probs truncated
        importance weights capped at off_policy_tis_cap when tis_cap is 0."""
        tis_cap = self.tis_cap
        if self.max_off_policy_steps > 0 and tis_cap == 0 and LOSSES[self.loss].tis == "engine":
            tis_cap = self.off_policy_tis_cap
        return RLLossOptions(name=self.loss, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                             tis_cap=tis_cap, cispo_cap=self.cispo_cap, kl_coef=self.kl_coef,
                             kl_estimator=self.kl_estimator)

    def loss_normaliser(self) -> tuple[Normaliser, float]:
        """(normaliser, constant) of the optimizer step: the loss's own (gspo: per sequence; dr_grpo:
        a constant) or optim.normaliser; the constant is the most completion tokens a step holds."""
        return loss_normaliser(self.loss, self.optim.normaliser, self.prompts_per_step * self.group_size,
                               self.sampling.max_new_tokens)

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        check_loss_choice(self.loss_options(), normalize_std=self.normalize_std, normaliser=self.optim.normaliser)
        if self.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer ({self.overlong_buffer}) exceeds rl.sampling.max_new_tokens "
                             f"({self.sampling.max_new_tokens})")
        if self.max_off_policy_steps > 0 and self.ppo_epochs > 1:
            raise ValueError("rl.max_off_policy_steps >= 1 needs rl.ppo_epochs = 1 (policy versions then "
                             "count steps, which the staleness bound is stated in)")
        if self.buffer.sampling == "reservoir" and self.buffer.reservoir_size < self.prompts_per_step:
            raise ValueError(f"rl.buffer.reservoir_size ({self.buffer.reservoir_size}) is smaller than "
                             f"rl.prompts_per_step ({self.prompts_per_step}): the reservoir could never fill a batch")
        if self.buffer.sampling == "reservoir" and not self.drop_zero_variance:
            raise ValueError("rl.buffer.sampling = 'reservoir' holds groups with non-zero advantages: it needs "
                             "rl.drop_zero_variance = true")
        module, _, cls = self.batch_maker.partition(":")
        if self.batch_maker and not (module and cls):
            raise ValueError(f"rl.batch_maker must be 'module:Class', got {self.batch_maker!r}")
        if self.partial_rollouts and self.max_off_policy_steps == 0:
            raise ValueError("rl.partial_rollouts needs rl.max_off_policy_steps >= 1 (synchronous RL samples "
                             "nothing while the weights change)")
        return self
