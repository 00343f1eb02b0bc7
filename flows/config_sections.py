"""The sections of a run's config (`[model]`, `[train]`, `[rl]`, ...): typed, documented, strict.

`flows.config` assembles them into `RunConfig` and holds the cross-section checks and loading;
import from there (it re-exports every section).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              allow_inf_nan=False)


class LoraSection(Section):
    rank: int = Field(0, ge=0)
    """LoRA adapter rank (0 = off: every weight trains). Needs the `lora` extra (peft). Works
    under train.parallel (ddp and fsdp2): every rank injects the same adapters."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the update is alpha / rank x B.A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
    """Linear modules that get adapters."""


class ModelConfig(Section):
    preset: str = "tiny-dense"
    """Named model preset (models/presets.py) used when `path` is empty."""
    path: str = ""
    """A local Hugging Face checkpoint directory to start from instead of a preset."""
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


class TrainConfig(Section):
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them:
    much less memory for long packs, about a third more compute."""
    compile: bool = False
    """torch.compile each decoder layer of the trained model (one shared graph, dynamic lengths;
    on CUDA the varlen attention inside it, on the CPU left eager) and, on CUDA, the chunked
    log-softmax kernels: fuses the norms, rotary, SwiGLU, autocast casts and vocabulary passes that
    dominate an eager GPU train step. Costs a compile at the first step (~40 s on a CPU with 2 cores)
    for ~1.2x faster steps there; off by default until a GPU run measures it (models/compile.py).
    Not with activation_checkpointing."""
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


class RewardModelConfig(Section):
    name: str
    """Component name in scores.components (e.g. "rm", "judge")."""
    type: Literal["classifier", "judge"]
    """classifier: a sequence-classification reward model; judge: an LLM judge (torch engine)."""
    path: str
    """classifier: a Hugging Face AutoModelForSequenceClassification directory; judge: a causal
    LM checkpoint directory."""
    weight: float = 1.0
    """Weight of this score in the reward (reward = env_reward_weight * env reward + sum)."""
    label: int | str | None = None
    """classifier with several labels: the label whose probability is the score (default: the last)."""
    batch_size: int = Field(16, ge=1)
    """classifier: sequences per forward pass."""
    prompt: str = ""
    """judge: prompt with a {conversation} field; '' = envs.reward_models.JUDGE_PROMPT."""


class TaskConfig(Section):
    env: str = "arithmetic"
    """Environment name: arithmetic | calculator | countdown | dataset | verifiers."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Environment options (e.g. digits, operators, path, prompt_column); checked by the env."""
    eval_examples: int = Field(200, ge=1)
    """Held-out prompts used for greedy evaluation."""
    reward_models: list[RewardModelConfig] = Field(default_factory=list)
    """Model rewards added to the environment's (envs/reward_models.py), each a scores component."""
    env_reward_weight: float = 1.0
    """Weight of the environment's own reward when reward_models are set."""
    reward_timeout_s: float = Field(0.0, ge=0)
    """Seconds one reward call may take (0 = no limit). A call over it is recorded as a reward
    error (reward 0), counted in the share that fails a step (rl.max_reward_error_fraction)."""


class OptimConfig(Section):
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
    normaliser: Literal["token", "sequence", "constant"] = "token"
    """Loss normaliser over the whole optimizer step."""


class SupervisedConfig(Section):
    steps: int = Field(100, ge=0)
    """Optimizer steps."""
    sequences_per_step: int = Field(64, ge=1)
    """Sequences per optimizer step."""
    examples: int = Field(20000, ge=1)
    """Training examples drawn from the task (SFT) or documents (pretrain)."""
    data_path: str = ""
    """Pretrain: a text or JSONL file of documents; SFT: a JSONL of chat conversations.
    Empty = build from the task's environment."""
    seq_len: int = Field(256, ge=8)
    """Pretrain: document chunk length in tokens."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and batching."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N steps (0 = only at the end)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only the last)."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the loss evaluates the same tempered policy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(16, ge=1)
    """Completion length limit."""


class RLConfig(Section):
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
    max_off_policy_steps: int = Field(0, ge=0)
    """Async RL: rollouts of the next k steps are generated while the current step trains
    (0 = synchronous, on-policy). A trained sample lags the updated weights by at most
    max(k, max_staleness) policy versions; older ones are dropped as stale."""
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
    loss: Literal["reinforce", "ppo_clip", "gspo", "cispo", "dr_grpo"] = "reinforce"
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
    Under train.parallel only rank 0 holds the copy: it computes the reference log-probs of every
    micro-batch and they travel with the step's batches to the rank that trains each."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
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


class EngineConfig(Section):
    type: Literal["torch", "http", "vllm"] = "torch"
    """Inference engine: in-process torch, OpenAI-compatible HTTP servers, or in-process vLLM."""
    urls: list[str] = Field(default_factory=list)
    """HTTP engine: server base URLs (requests are spread across them)."""
    timeout_s: float = Field(60.0, gt=0)
    """HTTP engine: per-request timeout."""
    retries: int = Field(3, ge=0)
    """HTTP engine and sync: retries on connection errors (with backoff)."""
    api_token_env: str = "RLPIPE_API_TOKEN"
    """HTTP engine: environment variable holding the servers' bearer token (unset or empty = none).
    The token itself is never a config value, so it never reaches config.json, MLflow or logs."""
    api_token_file: str = ""
    """HTTP engine: a file holding the bearer token (first line); takes precedence over api_token_env."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline_token(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_token" in data:
            raise ValueError("engine.api_token is not accepted: a token in the config would be written to "
                             "config.json and MLflow; put it in $RLPIPE_API_TOKEN (engine.api_token_env) "
                             "or a file (engine.api_token_file)")
        return data
    sync_every: int = Field(1, ge=1)
    """Send the trainer's weights to the engines every N steps (servers: a checkpoint each time);
    at most rl.max_off_policy_steps + 1, so that samples stay within the staleness bound."""
    cuda_graphs: bool = False
    """Torch engine on CUDA: replay each decode step as one CUDA graph (engines/decode_graphs.py),
    which removes the kernel-launch overhead that bounds decoding of small models at large
    batches. Costs: its KV cache (engine max batch x longest prompt + max_new_tokens) stays
    allocated while the trainer trains, and MoE blocks run every expert on every token. Off by
    default until a GPU run has measured it (docs/BENCHMARKS_GPU.md); ignored, with a log line,
    on CPU and for models without the fast Qwen3 path; not used by the snapshot engine of
    rl.max_off_policy_steps > 0. vLLM engine: let vLLM compile and capture its CUDA graphs
    (its own default, as TRL runs it; false = enforce_eager, which starts faster)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vLLM engine: share of GPU memory vLLM may hold while generating (weights + KV cache); it
    sleeps, releasing it, while the trainer trains. Ignored by vLLM's CPU build."""
    max_model_len: int = Field(0, ge=0)
    """vLLM engine: longest prompt + completion it plans its KV cache for; 0 = the model's
    max_position_embeddings (40,960 for Qwen3: lower it to leave memory to a smaller GPU)."""


class TrackingConfig(Section):
    enabled: bool = True
    """Log to MLflow (a SQLite database under runs_root unless MLFLOW_TRACKING_URI is set)."""
    experiment: str = "rlpipe"
    """MLflow experiment name."""
    registered_model: str = ""
    """Register checkpoints as versions of this model ('' = the run name)."""
    report: bool = True
    """Write <run_dir>/report.html at the end of the run."""
    prefect_task_runs: bool = True
    """One Prefect task run per stage, seen in the Prefect UI. false: stages are plain calls inside
    the flow run (3-10 ms less per stage: worth it when steps take well under a second)."""
