"""The engine contract: prompt token ids in, n sampled completions with log-probs out.

Every engine (in-process `torch`, `http`, `vllm`) takes the same `SamplingParams` and returns
`Completion` records, so rollouts do not know which engine made them.

Log-prob convention (what `Completion.logprobs` holds): the log-probability of each sampled token
under the *tempered, untruncated* policy, `log_softmax(logits / temperature)[token]`. top-k and
top-p only restrict which tokens may be drawn; they do not renormalise the reported log-prob.
This is the quantity the trainer recomputes from a plain forward pass of prompt + completion
(it knows the temperature, not the truncation), so ratios in PPO-style losses compare like with
like. Greedy decoding reports log-probs at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions; validated on construction (`ValueError` names the field)."""

    n: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """Logits are divided by this before softmax; > 0 (ignored when `greedy`)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p; (0, 1]."""
    top_k: int = 0
    """Draw only from the k most likely tokens; 0 = no limit."""
    max_new_tokens: int = 64
    """Upper bound on completion length (finish_reason 'length' when reached)."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the completion (the stop token is kept, finish_reason 'stop')."""
    seed: int | None = None
    """Same seed, prompts and weights -> same completions. None: a fresh random seed per call."""
    greedy: bool = False
    """Argmax decoding; log-probs are reported at temperature 1."""
    max_thinking_tokens: int = 0
    """Thinking budget (0 = none): a completion that has spent this many tokens inside its
    reasoning block gets `think_ids[1]` (`</think>`) as its next token, then samples on. The
    forced token's log-prob is the policy's own for it. Only the torch engine honours it."""
    think_ids: tuple[int, int] | None = None
    """(`<think>`, `</think>`) token ids; the block may open in the prompt. Needed by a budget."""

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature > 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        stops = tuple(self.stop_token_ids)
        for tok in stops:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {tok!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.greedy, bool):
            raise ValueError(f"greedy must be a bool, got {self.greedy!r}")
        _check_int("max_thinking_tokens", self.max_thinking_tokens, minimum=0)
        if self.think_ids is not None:
            object.__setattr__(self, "think_ids", tuple(self.think_ids))
            if len(self.think_ids) != 2 or not all(isinstance(t, int) and t >= 0 for t in self.think_ids):
                raise ValueError(f"think_ids must be two token ids (<think>, </think>), got {self.think_ids!r}")
        if self.max_thinking_tokens and self.think_ids is None:
            raise ValueError("max_thinking_tokens needs think_ids (the <think> and </think> token ids)")


def prompt_seed(params: SamplingParams, prompt_index: int) -> int | None:
    """The seed of prompt `prompt_index`'s own request, for engines (vLLM) that seed a request's
    n samples seed, seed+1, ...: one seed for every prompt of a batch would give sample j of
    each prompt the same noise, so each prompt starts n seeds after the previous one."""
    return None if params.seed is None else params.seed + prompt_index * params.n


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    tokens: list[int]
    """Completion token ids (prompt excluded; a final stop token included)."""
    logprobs: list[float] = field(default_factory=list)
    """logprobs[i]: log-prob of tokens[i] under softmax(logits / temperature), untruncated."""
    finish_reason: FinishReason = "length"
    """'stop' (a stop token was sampled) or 'length' (max_new_tokens reached)."""
    versions: list[int] | None = None
    """versions[i]: the policy version whose weights sampled tokens[i], where the engine tells
    (an in-process engine with partial rollouts, engines/snapshot.py); None otherwise."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for {len(self.tokens)} tokens"
            )
        if self.versions is not None and len(self.versions) != len(self.tokens):
            raise ValueError(f"versions has {len(self.versions)} entries for {len(self.tokens)} tokens")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(
                f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}"
            )


@runtime_checkable
class Engine(Protocol):
    """What rollout generation needs from an inference engine."""

    shares_weights: bool
    """True when the engine samples from the trainer's own tensors (sees every update with no
    sync); False when it holds its own copy that `sync` refreshes."""
    syncs_from_checkpoint: bool
    """True when `sync` needs a checkpoint folder on disk (servers); False when it takes the
    trainer's weights in-process."""

    @property
    def policy_version(self) -> int:
        """Optimizer steps applied to the weights the engine samples from."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (in order), `params.n` completions (in order)."""
        ...

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """Make the engine sample from the given weights (None: weights are shared in-process)."""
        ...

    def close(self) -> None:
        """Release resources; the engine is unusable afterwards."""
        ...
