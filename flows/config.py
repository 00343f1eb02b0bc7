"""Run configuration: one TOML file validated into typed models.

Every field has a docstring (shown by `rlpipe run --help-config`); unknown keys are rejected with
their dotted name; `--set a.b=c` overrides a value before validation. The resolved config is
written to `<run_dir>/config.json` and logged to MLflow as params.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator
from rlpipe.flows.config_sections import (  # noqa: F401 (re-exported: callers import sections from here)
    ConfigError,
    EngineConfig,
    LoraSection,
    ModelConfig,
    OptimConfig,
    RewardModelConfig,
    RLConfig,
    SamplingConfig,
    Section,
    SupervisedConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
)


class RunConfig(Section):
    flow: Literal["pretrain", "sft", "rl", "pipeline"] = "pipeline"
    """Which flow `rlpipe run` starts."""
    run_name: str = "run"
    """Run directory name under runs_root."""
    runs_root: str = "runs"
    """Folder holding run directories and the default MLflow database."""
    seed: int = 0
    """Seed of every random choice (data order, sampling, init)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Torch device of the model, optimizer, batches and in-process engine: auto (CUDA when torch
    sees a GPU, else CPU) | cpu | cuda | cuda:N. Asking for cuda without one is an error."""
    threads: int = Field(0, ge=0)
    """Torch intra-op threads (0 = torch's default). Tiny models are overhead-bound: 1 is often
    as fast, and much steadier when other processes share the cores."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model to train."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """Environment / data."""
    pretrain: SupervisedConfig = Field(default_factory=lambda: SupervisedConfig(steps=0))
    """Pretraining phase (flow = pretrain)."""
    sft: SupervisedConfig = Field(default_factory=SupervisedConfig)
    """SFT phase (flow = sft or pipeline)."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """RL phase (flow = rl or pipeline)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """How the trainer runs (memory/compute trade-offs shared by every phase)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Rollout engine."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow tracking and the report."""

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        bad = non_finite_keys(data)
        if bad:
            raise ValueError(f"{bad[0]} must be a finite number (inf and nan are refused)")
        return data

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.engine.type == "http" and not self.engine.urls:
            raise ValueError("engine.urls must list at least one server when engine.type = 'http'")
        if self.rl.loss == "ppo_clip" and self.rl.tis_cap > 0:
            raise ValueError("rl.tis_cap with rl.loss = 'ppo_clip' is not supported: the PPO ratio "
                             "against the engine's log-probs already absorbs the mismatch")
        _check_rl_loss(self.rl)
        if self.train.compile and self.train.activation_checkpointing:
            raise ValueError("train.compile with train.activation_checkpointing is not supported: the "
                             "checkpointed layers would run uncompiled (models/compile.py); turn one off")
        if self.engine.type == "vllm" and self.train.parallel != "none":
            raise ValueError(
                f"engine.type = 'vllm' with train.parallel = {self.train.parallel!r} is not supported: vLLM in "
                "rank 0's process sets up its parallel groups on the process group the training ranks "
                "share, and such a run hung (ddp, vLLM's CPU build); sample from vLLM servers instead "
                "(engine.type = 'http', vllm+http:// urls)")
        k = self.rl.max_off_policy_steps
        if self.engine.sync_every > k + 1:
            raise ValueError(f"engine.sync_every = {self.engine.sync_every} exceeds rl.max_off_policy_steps + 1 "
                             f"= {k + 1}: engines would sample from weights older than the staleness bound")
        if k > 0 and self.rl.ppo_epochs > 1:
            raise ValueError("rl.max_off_policy_steps >= 1 needs rl.ppo_epochs = 1 (policy versions then "
                             "count steps, which the staleness bound is stated in)")
        check_plain_name(self.run_name, "run_name")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_root) / self.run_name


def check_plain_name(name: str, key: str) -> str:
    """`name` if it is one plain folder name: no separator, not '.' or '..', no control character,
    no surrounding spaces (a run_name of '..' would put the run, and --overwrite, outside runs_root)."""
    if (not name or name != name.strip() or name in (".", "..") or any(c in name for c in "/\\")
            or any(ord(c) < 32 for c in name)):
        raise ValueError(f"{key} must be a plain folder name (no '/', '\\', '.' or '..'), got {name!r}")
    return name


def non_finite_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every inf or nan float in a nested dict/list (TOML accepts `inf` and `nan`)."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [prefix or "(value)"]
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list | tuple):
        items = enumerate(data)
    else:
        return []
    return [key for name, value in items
            for key in non_finite_keys(value, f"{prefix}.{name}" if prefix else str(name))]


def _check_rl_loss(rl: RLConfig) -> None:
    """Combinations the chosen loss does not define."""
    if rl.tis_cap > 0 and rl.loss in ("gspo", "cispo", "dr_grpo"):
        raise ValueError(f"rl.tis_cap is for reinforce and ppo_clip; rl.loss = {rl.loss!r} weights "
                         "tokens by its own importance ratio")
    if rl.loss == "dr_grpo" and rl.normalize_std:
        raise ValueError("rl.loss = 'dr_grpo' removes the std normalisation: set rl.normalize_std = false")
    own = {"gspo": "sequence", "dr_grpo": "constant"}.get(rl.loss)
    if own and "normaliser" in rl.optim.model_fields_set and rl.optim.normaliser != own:
        raise ValueError(f"rl.loss = {rl.loss!r} is normalised per {own}; rl.optim.normaliser = "
                         f"{rl.optim.normaliser!r} contradicts it (leave it unset)")
    if rl.overlong_buffer > rl.sampling.max_new_tokens:
        raise ValueError(f"rl.overlong_buffer ({rl.overlong_buffer}) exceeds rl.sampling.max_new_tokens "
                         f"({rl.sampling.max_new_tokens})")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b=c`; the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    keys = [part.strip() for part in key.split(".")]
    if not all(keys):
        raise ConfigError(f"--set has an empty key part in {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = json.loads(json.dumps(data))
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for part in keys[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def validate_config(data: dict, source: str = "") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config {path} is not valid TOML: {error}") from None
    return validate_config(apply_overrides(data, list(overrides)), str(path))


def describe_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default, docstring."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"[{prefix}{name}]  {field.description or ''}")
            lines += describe_fields(annotation, f"{prefix}{name}.")
        else:
            default = field.get_default(call_default_factory=True)
            lines.append(f"  {prefix}{name} = {default!r}  # {field.description or ''}")
    return lines
