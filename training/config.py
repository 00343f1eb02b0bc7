"""The config sections of what trains: the model and its LoRA adapters (`[model]`), the trainer
(`[train]`), optimizers (`optim` of each phase), the supervised phases (`[pretrain]`, `[sft]`) and
the policy loss (`[rl.loss]`).

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes them into a run's
`RunConfig`, and rollouts/config.py the `[rl]` section around `[rl.loss]` and `[rl.optim]`. The
policy loss's choices are checked by its registry (training/rl_loss.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from rlpipe.core.config import Section, check_shares, options_from
from rlpipe.training.loss_choice import DEFAULT_TARGETS, KL_ESTIMATORS, LOSS_NAMES, LoraOptions


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
        return options_from(LoraOptions, self, targets=tuple(self.targets))


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
    master copy; small updates round away unless a phase's `optim.optimizer` is "adamw_bf16_sr");
    float32 is the default (with bf16_autocast)."""
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
    pip install 'rlpipe[liger]'; an error where either is missing); "auto" does so only where both
    are present, the model is a Qwen3 and its layers are not compiled: under train.compile (the
    CUDA default) Liger measured 36% slower per H100 step than compile alone (0.547 against
    0.403 s, docs/BENCHMARKS_GPU.md), so "auto" leaves a compiled model to the compiler; "none"
    never patches. The vocabulary head is `logprobs`'s, never Liger's."""
    logprobs: Literal["auto", "fused", "chunked"] = "auto"
    """The LM head's log-prob path (training/fused_head.py): "chunked" is rlpipe's chunked linear +
    log-softmax (training/logprobs.py), which never holds the [tokens, vocab] logits but writes and
    re-reads [chunk, vocab] float32 blocks; "fused" is Apple's Cut Cross-Entropy (the `cce` extra:
    pip install 'rlpipe[cce]'), which never writes logits at all, with exact gradients (its
    gradient filter off); where it cannot run (no CUDA, not installed, an LM head with a bias, a
    float32 head without bf16 autocast) the chunked path runs and one log line says why. "auto" is
    the chunked path, by measurement: the fused head made a compiled qwen3-0.6b step 21% slower
    (0.446 against 0.367 s, docs/BENCHMARKS_GPU.md) while holding less memory, so "fused" is a
    memory option. Entropy metrics always use the chunked path, without gradient."""
    parallel: Literal["none", "ddp", "fsdp2"] = "none"
    """Data parallelism over the ranks of `rlpipe run --nproc-per-node N` (or torchrun): ddp
    replicates the model, fsdp2 shards it per transformer block (bf16 params, fp32 gradient
    reduction on CUDA). NCCL on CUDA, gloo on CPU. Rank 0 runs the flow, tables, MLflow and
    engines (not engine.type = "vllm": use vLLM servers); the other ranks only train. "none" with
    --nproc-per-node means ddp. rl.loss.kl_coef, model.lora and the entropy metric work under both
    (docs/ARCHITECTURE.md, ranks)."""
    parallel_timeout_s: float = Field(1800.0, gt=0)
    """Seconds a rank waits in a collective before failing: the other ranks wait while rank 0
    generates, scores, evaluates and checkpoints, so it must exceed the longest of those."""
    peer_timeout_s: float = Field(30.0, ge=5)
    """Seconds without a heartbeat from a data-parallel rank (each beats once a second from a thread
    of its own, whatever its main thread does) after which the others count it lost: the run
    stops with a line naming it (training/peer_watch.py). A peer that died is noticed sooner, at
    the next collective; this bounds the rest, a machine that vanished included. At least 5 s, so
    a rank briefly starved of CPU is not taken for lost."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.compile and self.activation_checkpointing:
            raise ValueError("train.compile with train.activation_checkpointing is not supported: the "
                             "checkpointed layers would run uncompiled (models/compile.py); turn one off")
        return self


class OptimConfig(Section):
    """`optim` of a phase: the optimizer, its schedule and the micro-batch size."""

    optimizer: Literal["adamw", "adamw_bf16_sr"] = "adamw"
    """"adamw": torch's AdamW, its state in the weights' dtype. "adamw_bf16_sr": torchao's AdamW with
    bf16 stochastic rounding (the `lean` extra: pip install 'rlpipe[lean]'), for
    `model.weights_dtype = "bfloat16"`: updates below a weight's bf16 spacing still move it on
    average, where plain bf16 AdamW rounds most of them away at RL learning rates, with no fp32
    master copy (training/step.py `build_optimizer`)."""
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
        if self.data:
            check_shares([source.weight for source in self.data], [source.path for source in self.data], "sft.data")
        if self.optim.normaliser == "constant":
            raise ValueError("optim.normaliser = 'constant' divides by the most completion tokens an RL step "
                             "holds, which a supervised phase does not have: use 'token' or 'sequence'")
        return self


class LossConfig(Section):
    """`[rl.loss]`: the policy loss (training/rl_loss.py) and how many optimizer steps each
    rollout batch gets."""

    type: Literal[LOSS_NAMES] = "reinforce"
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
    tis_cap: float = Field(0.0, ge=0)
    """Truncated importance weight cap for engine/trainer mismatch (0 = off; async RL has its
    own default, rl.off_policy.tis_cap)."""
    ppo_epochs: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (PPO)."""
