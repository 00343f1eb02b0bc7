"""The config section of the rollout engines (`[engine]`): which engine samples, how it is reached
and how often it receives the trainer's weights.

Typed, documented, strict (core/config.py `Section`); tasks/config.py composes it into a run's
`RunConfig`. A key that was removed is refused with why (`REMOVED`); a stored run's config.json
that still holds it is read without it (tasks/config.py `read_run_config`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from rlpipe.core.config import Section

# removed keys -> why, in a few words (core/config.py `removed_key_errors`)
REMOVED: dict[str, str] = {
    "engine.zero_copy": "vLLM sharing the trainer's tensors had to run without CUDA graphs (generation about 3x "
                        "slower) to save memory no target needs; delete the line (docs/DESIGN.md, \"Why vLLM gets "
                        "a copy of the weights\")",
}


class EngineConfig(Section):
    """`[engine]`: the rollout engines."""

    type: Literal["torch", "http", "vllm", "auto"] = "torch"
    """Inference engine: in-process torch, OpenAI-compatible HTTP servers, or in-process vLLM.
    auto: vLLM when the trained model sits on a CUDA GPU, vLLM is installed and one process
    trains; the torch engine otherwise (a CPU, no vLLM, several ranks)."""
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
    at most rl.off_policy.max_steps + 1, so that samples stay within the staleness bound."""
    cuda_graphs: bool = False
    """Torch engine on CUDA: replay each decode step as one CUDA graph (engines/decode_graphs.py),
    which removes the kernel-launch overhead that bounds decoding of small models at large
    batches. Costs: its KV cache (engine max batch x longest prompt + max_new_tokens) stays
    allocated while the trainer trains, and MoE blocks run every expert on every token. Off by
    default until a GPU run has measured it (docs/BENCHMARKS_GPU.md); ignored, with a log line,
    on CPU and for models without the fast Qwen3 path; not used by the snapshot engine of
    rl.off_policy.max_steps > 0. vLLM engine: let vLLM compile and capture its CUDA graphs
    (its own default, as TRL runs it; false = enforce_eager, which starts faster)."""
    producer: Literal["thread", "process"] = "thread"
    """Torch engine with rl.off_policy.max_steps >= 1: where the sampler of the rollouts generated
    ahead runs. thread: a weights snapshot sampled in a thread of the trainer's process (shares
    its interpreter lock); process: a child process sampling from shared-memory weights that each
    sync refreshes (engines/process_engine.py; not with rl.off_policy.partial_rollouts)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vLLM engine: share of GPU memory vLLM may hold while generating (weights + KV cache); it
    sleeps, releasing it, while the trainer trains. Ignored by vLLM's CPU build."""
    max_model_len: int = Field(0, ge=0)
    """vLLM engine: longest prompt + completion it plans its KV cache for; 0 = the model's
    max_position_embeddings (40,960 for Qwen3: lower it to leave memory to a smaller GPU)."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.type == "http" and not self.urls:
            raise ValueError("engine.urls must list at least one server when engine.type = 'http'")
        return self
