"""The embedded `torch` engine: batched sampling in-process, on the trainer's own weights.

    engine = TorchEngine(model)                     # the nn.Module the optimizer updates
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=128, seed=0))
    out[i][j].tokens, out[i][j].logprobs, out[i][j].finish_reason

How it is fast on CPU:
- Qwen3 / Qwen3-MoE models decode through `engines.qwen3_fast` (a lean forward over a
  preallocated KV cache); other architectures fall back to the Hugging Face forward with its
  DynamicCache (same sampling, slower).
- Each prompt is prefilled once and its cache copied to its n samples.
- Prompts are sorted by length before being cut into batches of `max_batch_size` sequences, so
  little padding is computed; each batch is sampled by engines/decode_loop.py `generate_batch`,
  where finished sequences leave the batch (the cache is compacted once an eighth of the rows
  are done), so long tails do not cost the whole batch.

Weights are read at the start of every `generate`, so after an optimizer step the next call
samples from the new weights with no sync (`sync(None, v)` only records the policy version).
Sampling draws one uniform per sequence and step from a `torch.Generator` seeded by
`params.seed`: same seed, prompts and weights -> same completions.

A thinking budget (`params.max_thinking_tokens`) is kept in the sampling loop
(engines/decode_loop.py): a sequence that has spent the budget inside its `<think>` block
(opened by its prompt or by itself) gets `</think>` as its next token and goes on sampling its
answer.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from rlpipe.engines import qwen3_fast
from rlpipe.engines.base import Completion, SamplingParams
from rlpipe.engines.decode_graphs import DecodeGraphs, GraphBackend
from rlpipe.engines.decode_loop import Backend, compact_by_fraction, generate_batch
from rlpipe.engines.qwen3_support import unsupported_reason
from torch import nn

log = logging.getLogger(__name__)


class TorchEngine:
    """In-process engine over a causal LM `model` (shared, not copied).

    device / dtype: where and in which dtype to run; default the model's own. A different
    dtype or device casts a copy of the weights at each `generate` call (still no sync needed);
    models without the fast path run through their HF forward where they are, in their dtype.
    max_batch_size: sequences (prompts x n) decoded together at most.
    cuda_graphs: on a CUDA device, replay each decode step as a CUDA graph
    (engines/decode_graphs.py; it keeps a max_batch_size KV cache allocated between calls).
    Elsewhere, or for models without the fast path, it is ignored with one log line.
    """

    shares_weights = True
    syncs_from_checkpoint = False

    def __init__(
        self,
        model: nn.Module,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 128,
        policy_version: int = 0,
        cuda_graphs: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        param = next(model.parameters())
        self.model = model
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        self.max_batch_size = max_batch_size
        self.fast_path_reason = unsupported_reason(model)
        """None when the lean Qwen3 forward is used; otherwise why the HF forward is."""
        if self.fast_path_reason is not None and self.device != param.device:
            raise ValueError(
                f"device {self.device} differs from the model's ({param.device}); only Qwen3 "
                f"models can run elsewhere ({self.fast_path_reason})"
            )
        self._policy_version = policy_version
        self._closed = False
        self._graphs = self._decode_graphs(cuda_graphs)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def sync(self, checkpoint_path: str | None, policy_version: int) -> None:
        """In-process weights are shared, so with no path this only records the version.
        With a path (a Hugging Face checkpoint folder), its weights are copied into the model."""
        self._check_open()
        if checkpoint_path is not None:
            load_weights_into(self.model, checkpoint_path)
        self._policy_version = policy_version

    def close(self) -> None:
        self._closed = True
        if self._graphs is not None:
            self._graphs.release()

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_token: TokenCallback | None = None,
                 pause: Callable[[], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """For each prompt (in order), `params.n` completions (in order).

        on_token(i, j, token, logprob): called (in this thread) with each token of completion j
        of prompt i as it is sampled, for streaming; the returned completions are the same.
        pause(): partial rollouts (engines/snapshot.py): called between two decode steps, it may
        change the weights and `sync` a new version meanwhile; sampling then goes on from the new
        weights (engines/decode_loop.py) and each completion carries its tokens' versions.
        cancelled(): asked before each decode step; once True, generation stops with
        engines.decode_loop.GenerationCancelled (`rlpipe serve`: nobody waits for the answer)."""
        self._check_open()
        vocab = self.model.config.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
        seed = params.seed if params.seed is not None else torch.Generator().seed()
        generator = torch.Generator().manual_seed(seed)
        # (prompt index, sample index), longest prompts first so batches pad little
        rows = [
            (i, j)
            for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
            for j in range(params.n)
        ]
        results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        was_training = self.model.training
        if self.fast_path_reason is not None:
            self.model.eval()  # the HF forward applies dropout in train mode
        try:
            with torch.inference_mode():
                backend, built = self._backend(), self._policy_version
                for start in range(0, len(rows), self.max_batch_size):
                    chunk = rows[start : start + self.max_batch_size]
                    if built != self._policy_version:  # weights changed during the last chunk
                        backend, built = self._backend(), self._policy_version
                    emit = None if on_token is None else functools.partial(_emit_row, on_token, chunk)
                    swap = None if pause is None else functools.partial(self._swap, pause)
                    done = generate_batch(
                        backend, [prompts[i] for i, _ in chunk], params, generator, self.device, emit,
                        swap=swap, version=self._policy_version, cancelled=cancelled,
                    )
                    for (i, j), completion in zip(chunk, done, strict=True):
                        results[i][j] = completion
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def _swap(self, pause: Callable[[], None]) -> tuple[int, Backend | None]:
        """decode_loop's swap hook: let `pause` change the weights, then a backend over them if
        the version moved."""
        before = self._policy_version
        pause()
        return self._policy_version, (None if self._policy_version == before else self._backend())

    def _backend(self) -> Backend:
        if self.fast_path_reason is None:
            weights = qwen3_fast.QwenWeights.from_model(self.model, self.dtype, self.device)
            if self._graphs is None:
                return FastBackend(weights)
            self._graphs.bind(weights)
            return GraphBackend(self._graphs)
        return HFBackend(self.model, self.device)

    def _decode_graphs(self, wanted: bool) -> DecodeGraphs | None:
        if not wanted:
            return None
        if self.fast_path_reason is not None or self.device.type != "cuda":
            why = self.fast_path_reason or f"device {self.device} is not CUDA"
            log.info("engine.cuda_graphs ignored (%s): decoding eagerly", why)
            return None
        return DecodeGraphs(self.max_batch_size, capture=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TorchEngine is closed")


def load_weights_into(model: nn.Module, checkpoint_path: str) -> None:
    """Copy the weights of the Hugging Face checkpoint at `checkpoint_path` into `model` in
    place (same parameter tensors afterwards). Raises ValueError if they do not match."""
    from transformers import AutoModelForCausalLM

    if not (Path(checkpoint_path) / "config.json").is_file():
        raise ValueError(f"checkpoint_path {checkpoint_path!r} has no config.json")
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint_path, dtype=torch.float32)
    source = dict(loaded.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in source or source[name].shape != param.shape:
                raise ValueError(f"checkpoint_path {checkpoint_path!r}: no matching {name!r}")
            param.copy_(source[name])


TokenCallback = Callable[[int, int, int, float], None]


def _emit_row(on_token: TokenCallback, chunk: list[tuple[int, int]], row: int, token: int,
              logprob: float) -> None:
    on_token(*chunk[row], token, logprob)


@functools.cache
def _forward_takes_cache(model_class: type) -> bool:
    return "cache" in inspect.signature(model_class.forward).parameters


def cache_keyword(model: nn.Module) -> str:
    """The KV-cache argument of an HF causal LM's forward: `cache` from transformers 5.24 (which
    maps the old name with a warning), `past_key_values` before."""
    return "cache" if _forward_takes_cache(type(model)) else "past_key_values"


class FastBackend:
    """The lean Qwen3 forward over a preallocated KV cache."""

    def __init__(self, weights: qwen3_fast.QwenWeights) -> None:
        self.weights = weights
        self.cache: qwen3_fast.KVCache | None = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, tokens: torch.Tensor, pad: torch.Tensor, max_len: int) -> torch.Tensor:
        self.rope = qwen3_fast.rope_tables(self.weights, max_len)
        self.cache = qwen3_fast.KVCache.empty(self.weights, tokens.shape[0], max_len)
        return qwen3_fast.prefill(self.weights, tokens, pad, self.cache, self.rope)

    def select(self, rows: torch.Tensor) -> None:
        assert self.cache is not None
        self.cache = self.cache.select(rows)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None and self.rope is not None
        return qwen3_fast.decode(self.weights, tokens, self.cache, self.rope, positions)

    def worth_compacting(self, rows: int, live: int) -> bool:
        return compact_by_fraction(rows, live)


class HFBackend:
    """Any Hugging Face causal LM, through its forward and DynamicCache (the slow path)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache = None
        self.mask: torch.Tensor | None = None

    def start(self, tokens: torch.Tensor, pad: torch.Tensor, max_len: int) -> torch.Tensor:
        from transformers import DynamicCache

        cols = torch.arange(tokens.shape[1], device=tokens.device)
        self.mask = (cols[None, :] >= pad[:, None]).long()
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=(cols[None, :] - pad[:, None]).clamp(min=0),
            **{cache_keyword(self.model): self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def select(self, rows: torch.Tensor) -> None:
        assert self.mask is not None and self.cache is not None
        self.cache.reorder_cache(rows)
        self.mask = self.mask[rows]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=positions[:, None],
            **{cache_keyword(self.model): self.cache},
            use_cache=True,
        )
        return out.logits[:, -1].float()

    def worth_compacting(self, rows: int, live: int) -> bool:
        return compact_by_fraction(rows, live)
