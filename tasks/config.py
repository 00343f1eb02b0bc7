"""Run configuration: one TOML file validated into typed models.

Every field has a docstring (shown by `rlpipe run --help-config`); unknown keys are rejected with
their dotted name; `--set a.b=c` overrides a value before validation. The resolved config is
written to `<run_dir>/config.json` and logged to MLflow as params.

Each `[section]` lives beside what it configures (training/config.py, rollouts/config.py,
engines/config.py, envs/config.py, storage/config.py) and checks its own keys; a key that moved is
refused with its new place, one that was removed with why, and a stored run's config.json is read
with its moved keys in place and its removed keys dropped (`read_run_config`); `RunConfig` composes them and holds
the checks that span sections. What sections share is core/config.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from rlpipe.core.config import (
    ConfigError,
    Section,
    apply_overrides,
    check_plain_name,
    format_validation_error,
    moved_key_errors,
    non_finite_keys,
    non_utf8_keys,
    removed_key_errors,
    with_moved_keys,
    without_removed_keys,
)
from rlpipe.engines.config import REMOVED, EngineConfig
from rlpipe.envs.config import TaskConfig
from rlpipe.rollouts.config import MOVED, RLConfig
from rlpipe.storage.config import TrackingConfig
from rlpipe.tasks.cluster_config import ClusterConfig
from rlpipe.training.config import (
    CheckpointConfig,
    ModelConfig,
    SupervisedConfig,
    TrainConfig,
)


class EvalConfig(Section):
    """`[eval]`: what the held-out eval measures besides its greedy completions (tasks/evaluate.py)."""

    samples: int = Field(0, ge=0, le=1024)
    """Sampled completions per held-out prompt, each an `evals` row beside the greedy one; they give
    eval/pass_at_1 .. eval/pass_at_<samples> (the unbiased pass@k) and, where the environment
    states a comparable answer, eval/maj_at_<samples>. 0: the greedy eval only."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the sampled evals."""


class RunConfig(Section):
    """A whole run: top-level keys and every section; holds the checks that span sections."""

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
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint retention."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where the score stage's reward calls run: in process, or on a Dask or Ray cluster."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evals: sampled completions beside the greedy ones (pass@k)."""

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        bad = non_finite_keys(data)
        if bad:
            raise ValueError(f"{bad[0]} must be a finite number (inf and nan are refused)")
        return data

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.engine.type == "vllm" and self.train.parallel != "none":
            raise ValueError(
                f"engine.type = 'vllm' with train.parallel = {self.train.parallel!r} is not supported: vLLM in "
                "rank 0's process sets up its parallel groups on the process group the training ranks "
                "share, and such a run hung (ddp, vLLM's CPU build); sample from vLLM servers instead "
                "(engine.type = 'http', vllm+http:// urls)")
        k = self.rl.off_policy.max_steps
        if self.engine.sync_every > k + 1:
            raise ValueError(f"engine.sync_every = {self.engine.sync_every} exceeds rl.off_policy.max_steps + 1 "
                             f"= {k + 1}: engines would sample from weights older than the staleness bound")
        if self.rl.off_policy.partial_rollouts and self.engine.type in ("http", "vllm"):
            raise ValueError(f"rl.off_policy.partial_rollouts needs the in-process engine (engine.type = 'torch' or 'auto'), "
                             f"got engine.type = {self.engine.type!r}")
        if self.engine.producer == "process":
            if self.engine.type not in ("torch", "auto") or k == 0:
                raise ValueError("engine.producer = 'process' is the sampler of the in-process torch engine for "
                                 f"async RL: it needs engine.type = 'torch' and rl.off_policy.max_steps >= 1 (got "
                                 f"engine.type = {self.engine.type!r}, rl.off_policy.max_steps = {k})")
            if self.rl.off_policy.partial_rollouts:
                raise ValueError("engine.producer = 'process' with rl.off_policy.partial_rollouts is not supported: a sync "
                                 "interrupts the generation in flight only in the trainer's process "
                                 "(engine.producer = 'thread')")
        if self.pretrain.data:
            raise ValueError("pretrain.data: a mixture of sources is for SFT ([[sft.data]]); pretraining reads "
                             "pretrain.data_path")
        if self.rl.sampling.max_thinking_tokens and self.engine.type != "torch":
            raise ValueError(f"rl.sampling.max_thinking_tokens needs engine.type = 'torch' (got "
                             f"{self.engine.type!r}): the thinking budget is enforced in its sampling loop")
        check_plain_name(self.run_name, "run_name")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_root) / self.run_name


def validate_config(data: dict, source: str = "") -> RunConfig:
    """The `RunConfig` of a nested dict; ConfigError naming every bad key (`source` says where from)."""
    bad = non_utf8_keys(data)
    if bad:  # before pydantic, whose own messages would have to quote the text
        key = bad[0].encode("utf-8", "backslashreplace").decode("utf-8")
        raise ConfigError(f"invalid config {source}".rstrip() + f": {key} is not valid UTF-8 text "
                          "(write it in UTF-8, e.g. a plain ASCII name)")
    moved = moved_key_errors(data, MOVED)
    if moved:  # one line: the first moved key and where it goes now
        raise ConfigError(f"invalid config {source}".rstrip() + f": {moved[0]}"
                          + (f" (and {len(moved) - 1} more moved key(s) of [rl])" if len(moved) > 1 else ""))
    removed = removed_key_errors(data, REMOVED)
    if removed:  # one line: the key and why it went
        raise ConfigError(f"invalid config {source}".rstrip() + f": {removed[0]}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source, RunConfig)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The `RunConfig` of a TOML file with `--set a.b=c` overrides applied; ConfigError if unusable."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"config {path} is not UTF-8 text: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config {path} is not valid TOML: {error}") from None
    try:
        return validate_config(apply_overrides(data, list(overrides)), str(path))
    except ConfigError:
        if not overrides:
            raise
        validate_config(data, str(path))  # the file alone is wrong: said against the file
        # else only the overrides made it wrong: said against them
        given = " ".join(overrides).encode("utf-8", "backslashreplace").decode("utf-8")  # printable as given
        return validate_config(apply_overrides(data, list(overrides)), f"(--set {given})")


def read_run_config(data: dict, source: str = "") -> RunConfig:
    """The `RunConfig` of a run's stored config.json: written by an earlier version, its moved
    keys are read at their new place and its removed keys dropped (a run resumes, replays and
    rescores as it was meant)."""
    return validate_config(stored_config_data(data), source)


def stored_config_data(data: dict) -> dict:
    """A stored config.json's dict with its moved keys at their new place and its removed keys
    dropped (to compare with a config of today's layout)."""
    return without_removed_keys(with_moved_keys(data, MOVED), REMOVED)
