"""The torch engine's sampling loop over one batch, whatever runs the model (engines/torch_engine.py
`FastBackend` / `HFBackend`, engines/decode_graphs.py `GraphBackend`):

    tokens, pad = left_pad(unique_prompts, device)
    completions = generate_batch(backend, prompts, params, generator, device, emit=None)

Equal prompts share one prefill, whose cache is copied to their samples. Finished sequences
leave the batch when the backend finds it worth compacting (the eager rule,
`compact_by_fraction`: once an eighth of the rows are done), so long tails do not cost the whole
batch. Sampling draws one uniform per sequence and step from `generator`.

A thinking budget (`params.max_thinking_tokens`) is kept in the loop: a sequence that has spent
the budget inside its `<think>` block (opened by its prompt or by itself) gets `</think>` as its
next token and goes on sampling its answer.

Partial rollouts: `swap()` is called between two decode steps and answers (version, backend):
a backend over new weights when they changed since the last call (None otherwise). The unfinished
sequences then go on with the new weights: their KV cache is recomputed by one prefill of prompt
plus the tokens sampled so far, so every later token (and its log-prob) is exactly the new
policy's; each token records the version that sampled it (`Completion.versions`).

Cancellation: `cancelled()`, when given, is asked before every decode step; once it answers
True the loop stops and raises `GenerationCancelled` (`rlpipe serve` stops the generation of a
request whose client has gone or whose deadline has passed, rather than finishing it for nobody).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from rlpipe.engines.base import Completion, SamplingParams
from rlpipe.engines.sampling import sample_next
from rlpipe.models.chat import ThinkTags, thinking_open

# Compact the batch once this fraction of its rows has finished: a compaction copies the
# filled cache once, about what one decode step reads, while a dead row costs every step.
_COMPACT_FRACTION = 1 / 8

class Backend(Protocol):
    """What `generate_batch` needs from a model runner (one batch at a time)."""

    def start(self, tokens: torch.Tensor, pad: torch.Tensor, max_len: int) -> torch.Tensor:
        """Prefill left-padded prompts tokens [U, P] (pad [U] columns each), room for max_len
        columns in all. Returns last-position logits float32 [U, V]."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (int64, may repeat: used to copy a prompt to n samples)."""
        ...

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (int64 [B]) at RoPE positions [B]; logits float32 [B, V],
        valid until the next call (a graph backend overwrites them in place)."""
        ...

    def worth_compacting(self, rows: int, live: int) -> bool:
        """Whether to drop finished rows now, `live` of `rows` still running."""
        ...


class GenerationCancelled(Exception):
    """`generate_batch` stopped because its `cancelled()` answered True."""


Swap = Callable[[], tuple[int, Backend | None]]
"""Between two decode steps: (policy version now, a backend over new weights or None)."""


def compact_by_fraction(rows: int, live: int) -> bool:
    """The eager rule: once `_COMPACT_FRACTION` of the rows are done."""
    return rows - live >= _COMPACT_FRACTION * rows


@dataclass
class _Batch:
    """Bookkeeping of one decoding batch; index b is a sequence of the batch as generated."""

    tokens: torch.Tensor  # int64 [B, max_new]
    logprobs: torch.Tensor  # float32 [B, max_new]
    lengths: list[int]
    reasons: list[str]
    versions: torch.Tensor | None = None  # int64 [B, max_new], with a swap


def generate_batch(
    backend: Backend,
    prompts: list[list[int]],
    params: SamplingParams,
    generator: torch.Generator,
    device: torch.device,
    emit: Callable[[int, int, float], None] | None = None,
    swap: Swap | None = None,
    version: int = 0,
    cancelled: Callable[[], bool] | None = None,
) -> list[Completion]:
    """Sample one completion per entry of `prompts` (equal prompts share one prefill).
    emit(row, token, logprob): called with each row's token as it is sampled (streaming).
    swap: the partial-rollout hook (module docstring); `version` is the policy version of the
    weights `backend` holds. With a swap, each completion carries its tokens' versions.
    cancelled(): asked before each decode step; True stops the loop (GenerationCancelled)."""
    unique: dict[tuple[int, ...], int] = {}
    source = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    tokens, pad = left_pad(list(unique), device)
    max_new = params.max_new_tokens
    logits = backend.start(tokens, pad, tokens.shape[1] + max_new)
    source_t = torch.tensor(source, device=device)
    if len(unique) != len(prompts):  # n > 1: copy each prompt's cache to its samples
        backend.select(source_t)
        logits = logits[source_t]
    n_rows = len(prompts)
    uniforms = (
        None if params.greedy else torch.rand(max_new, n_rows, generator=generator).to(device)
    )
    stop = torch.tensor(params.stop_token_ids, device=device) if params.stop_token_ids else None
    out = _Batch(
        tokens=torch.zeros(n_rows, max_new, dtype=torch.long, device=device),
        logprobs=torch.zeros(n_rows, max_new, dtype=torch.float32, device=device),
        lengths=[max_new] * n_rows,
        reasons=["length"] * n_rows,
        versions=None if swap is None else torch.zeros(n_rows, max_new, dtype=torch.long),
    )
    rows = torch.arange(n_rows, device=device)  # batch position -> sequence index
    live = torch.ones(n_rows, dtype=torch.bool, device=device)
    positions = torch.tensor([len(p) for p in prompts], device=device)
    budget = _ThinkingBudget.of(prompts, params, device)
    n_live = n_rows
    for t in range(max_new):
        if cancelled is not None and cancelled():
            raise GenerationCancelled(f"cancelled after {t} of {max_new} tokens")
        draws = None if uniforms is None else uniforms[t][rows]
        token, logprob = sample_next(logits, params, draws)
        if budget is not None:
            token, logprob = budget.apply(rows, token, logprob, logits, params)
        out.tokens[rows, t] = token
        out.logprobs[rows, t] = logprob
        if out.versions is not None:
            out.versions[rows.cpu(), t] = version
        if emit is not None:
            for b, tok, lp, alive in zip(rows.tolist(), token.tolist(), logprob.tolist(), live.tolist(),
                                         strict=True):
                if alive:
                    emit(b, tok, lp)
        if stop is not None:
            hit = torch.isin(token, stop) & live
            finished = rows[hit].tolist()
            for b in finished:
                out.lengths[b], out.reasons[b] = t + 1, "stop"
            if finished:
                live &= ~hit
                n_live -= len(finished)
        if t == max_new - 1 or n_live == 0:
            break
        if backend.worth_compacting(len(rows), n_live):
            keep = live.nonzero().squeeze(1)
            backend.select(keep)
            rows, positions, token, live = rows[keep], positions[keep], token[keep], live[keep]
        new = None
        if swap is not None:
            version, new = swap()
        if new is None:
            logits = backend.step(token, positions)
        else:  # new weights: recompute the cache of every unfinished sequence with them
            backend = new
            keep = live.nonzero().squeeze(1)
            rows, positions, live = rows[keep], positions[keep], live[keep]
            logits = _prefill_so_far(backend, prompts, out.tokens, rows, t + 1, max_new, device)
        positions = positions + 1
    tokens_cpu, logprobs_cpu = out.tokens.cpu(), out.logprobs.cpu()
    return [
        Completion(
            tokens=tokens_cpu[b, :n].tolist(),
            logprobs=logprobs_cpu[b, :n].tolist(),
            finish_reason=out.reasons[b],  # type: ignore[arg-type]
            versions=None if out.versions is None else out.versions[b, :n].tolist(),
        )
        for b, n in enumerate(out.lengths)
    ]


def _prefill_so_far(backend: Backend, prompts: list[list[int]], sampled: torch.Tensor, rows: torch.Tensor,
                    done: int, max_new: int, device: torch.device) -> torch.Tensor:
    """Start `backend` on each row's prompt plus its first `done` sampled tokens (room left for
    the rest of max_new); the logits of each row's next token."""
    so_far = sampled[rows, :done].tolist()
    seqs = [tuple(prompts[b]) + tuple(tokens) for b, tokens in zip(rows.tolist(), so_far, strict=True)]
    tokens, pad = left_pad(seqs, device)
    return backend.start(tokens, pad, tokens.shape[1] + max_new - done)


@dataclass
class _ThinkingBudget:
    """Per sequence: inside its reasoning block or not, and the reasoning tokens it has spent
    (the tags not counted). A sequence at the budget gets `</think>` instead of its draw."""

    start: int
    end: int
    limit: int
    inside: torch.Tensor  # bool [B]
    spent: torch.Tensor  # int64 [B]

    @classmethod
    def of(cls, prompts: list[list[int]], params: SamplingParams, device: torch.device) -> _ThinkingBudget | None:
        if not params.max_thinking_tokens or params.think_ids is None:
            return None
        start, end = params.think_ids
        tags = ThinkTags(start, end)
        inside = torch.tensor([thinking_open(p, tags) for p in prompts], dtype=torch.bool, device=device)
        return cls(start, end, params.max_thinking_tokens, inside, torch.zeros(len(prompts), dtype=torch.long,
                                                                                  device=device))

    def apply(self, rows: torch.Tensor, token: torch.Tensor, logprob: torch.Tensor, logits: torch.Tensor,
              params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens with `</think>` where a sequence's budget is spent (its log-prob the
        policy's own, as `sample_next` reports it), and the state moved past them."""
        inside = self.inside[rows]
        over = inside & (self.spent[rows] >= self.limit)
        if bool(over.any()):
            scaled = logits.float() if params.greedy else logits.float() / params.temperature
            forced = torch.log_softmax(scaled, dim=-1)[:, self.end]
            token = torch.where(over, torch.full_like(token, self.end), token)
            logprob = torch.where(over, forced.to(logprob.dtype), logprob)
        opens = ~inside & (token == self.start)
        closes = inside & (token == self.end)
        self.spent[rows] += (inside & ~closes).long()
        self.inside[rows] = (inside | opens) & ~closes
        return token, logprob


def left_pad(
    prompts: list[tuple[int, ...]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad with token 0 (masked). Returns tokens int64 [U, P] and pad int64 [U]."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return tokens.to(device), pad.to(device)
