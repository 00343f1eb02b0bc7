"""How a packed row is cut into padded attention buckets (pure index arithmetic, no kernels).

A view is one segment's attention problem: its query tokens and the key tokens they see (a
continuation segment's keys start with its shared prefix; see training.batch, "Shared prefixes").
Views of similar shape are padded together into buckets; `models.attention` runs one attention
call per bucket and scatters the outputs back to the packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative cost of one extra attention call (fwd + bwd), in units of attention pairs (query x key).
# Bucketing trades padding waste (n_b * L_b^2 pairs) against per-call overhead. On a small CPU
# (small-dense, 16 sequences of 32-256 tokens) step time was flat for costs 0-131k and 12-15%
# worse with a single bucket padded to the longest sequence; 32k sits in the flat region.
_CALL_COST_PAIRS = 32_768


@dataclass(frozen=True)
class AttentionBucket:
    """Views of the same padded shape, attended in one call.

    queries: int64 [n_b, Lq] indices into the T packed tokens of each view's query slots.
    keys:    int64 [n_b, Lk] the same for its key/value slots (padding slots repeat a real token).
    offset:  int64 [n_b] | None: query slot a sees key slots 0 .. a + offset (a shared prefix of
             `offset` tokens precedes the queries); None = plain causal, queries are the keys.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    offset: torch.Tensor | None


@dataclass(frozen=True)
class VarlenPlan:
    """How a packed row of T tokens is cut into padded buckets for attention.

    buckets: the attention calls.
    scatter: int64 [T], for each packed token its row in the concatenated bucket query outputs
             (flattened [sum_b n_b * Lq_b]).
    flash:   set instead of buckets when a varlen kernel runs the row unpadded (CUDA).
    """

    buckets: tuple[AttentionBucket, ...]
    scatter: torch.Tensor | None
    n_tokens: int
    flash: FlashViews | None = None


@dataclass(frozen=True)
class FlashViews:
    """The views of a packed row in the layout of a varlen (FlashAttention-style) kernel.

    Queries are the packed tokens in order (view i = segment i, rows cu_q[i]:cu_q[i+1]); its keys
    are rows cu_k[i]:cu_k[i+1] of the gathered key tokens `keys` (int64 [Tk]: the prefix segment's
    tokens, then its own), or of the packed tokens themselves when no segment has a prefix
    (`keys` None, cu_k = cu_q). Causality is aligned bottom-right: query a of view i sees keys
    0 .. a + (len_k - len_q), which is exactly "all of the prefix, then causal on its own tokens".
    """

    cu_q: torch.Tensor  # int32 [n+1]
    cu_k: torch.Tensor  # int32 [n+1]
    max_q: int
    max_k: int
    keys: torch.Tensor | None


def plan_buckets(
    seq_lens: list[int], call_cost: int = _CALL_COST_PAIRS, query_lens: list[int] | None = None
) -> list[list[int]]:
    """Group view indices into buckets minimising sum_b (n_b * max_q_b * max_k_b + call_cost).

    seq_lens are the key lengths; query_lens (default: the same) the query lengths. Views are
    sorted by key length (descending) and cut into contiguous runs by dynamic programming
    (O(n^2), n = views in the micro-batch). Deterministic.
    """
    q_lens = seq_lens if query_lens is None else query_lens
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], -q_lens[i], i))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted views
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        widest_q = 0
        for i in range(j - 1, -1, -1):  # bucket = sorted[i:j]; its key width is sorted[i]'s
            widest_q = max(widest_q, q_lens[order[i]])
            cost = best[i] + (j - i) * seq_lens[order[i]] * widest_q + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets: list[list[int]] = []
    j = n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def _check_prefixes(prefixes: list[int], n: int) -> None:
    if len(prefixes) != n:
        raise ValueError(f"prefix_index has {len(prefixes)} entries for {n} segments")
    for s, j in enumerate(prefixes):
        if j >= 0 and (j >= s or prefixes[j] >= 0):
            raise ValueError(f"segment {s}: prefix_index {j} must name an earlier segment without a prefix")


def _slots(starts: list[int], lens: list[int], width: int) -> torch.Tensor:
    """int64 [n, width]: start + t for t < len, padding repeats the start."""
    steps = torch.arange(width, dtype=torch.int64)[None, :]
    start = torch.tensor(starts, dtype=torch.int64)[:, None]
    size = torch.tensor(lens, dtype=torch.int64)[:, None]
    return torch.where(steps < size, start + steps, start)


def make_plan(
    cu_seqlens: torch.Tensor,
    call_cost: int = _CALL_COST_PAIRS,
    prefix_index: torch.Tensor | None = None,
) -> VarlenPlan:
    """The bucket plan for a packed row with boundaries `cu_seqlens` (int [n+1]).

    Every segment is one view. prefix_index (int [n] | None, see PackedBatch): a continuation
    segment's queries attend to its prefix segment's tokens, then causally to its own; the prefix
    is attended once, as its own plain view. Plain and continuation views go to separate buckets.
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    prefixes = [-1] * len(lens) if prefix_index is None else [int(x) for x in prefix_index.tolist()]
    _check_prefixes(prefixes, len(lens))
    pre_lens = [lens[j] if j >= 0 else 0 for j in prefixes]
    device = cu_seqlens.device
    buckets: list[AttentionBucket] = []
    scatter = torch.empty(cu[-1], dtype=torch.int64)
    offset = 0
    kinds = ([s for s in range(len(lens)) if prefixes[s] < 0], [s for s in range(len(lens)) if prefixes[s] >= 0])
    for kind, views in enumerate(kinds):
        key_lens = [lens[s] + pre_lens[s] for s in views]
        for bucket in plan_buckets(key_lens, call_cost, [lens[s] for s in views]):
            segs = [views[v] for v in bucket]
            q_width = max(lens[s] for s in segs)
            queries = _slots([cu[s] for s in segs], [lens[s] for s in segs], q_width)
            if kind == 0:
                keys, shift = queries, None
            else:
                k_width = max(key_lens[v] for v in bucket)
                pre = _slots([cu[prefixes[s]] for s in segs], [pre_lens[s] for s in segs], k_width)
                own = _slots([cu[s] for s in segs], [lens[s] for s in segs], k_width)
                shift = torch.tensor([pre_lens[s] for s in segs], dtype=torch.int64)
                steps = torch.arange(k_width, dtype=torch.int64)[None, :]
                own = own.gather(1, (steps - shift[:, None]).clamp(min=0, max=k_width - 1))
                keys = torch.where(steps < shift[:, None], pre, own)
            buckets.append(AttentionBucket(queries.to(device), keys.to(device),
                                           None if shift is None else shift.to(device)))
            valid = torch.arange(q_width)[None, :] < torch.tensor([lens[s] for s in segs])[:, None]
            rows = offset + torch.arange(len(segs) * q_width, dtype=torch.int64).view(len(segs), q_width)
            scatter[queries[valid]] = rows[valid]
            offset += len(segs) * q_width
    return VarlenPlan(buckets=tuple(buckets), scatter=scatter.to(device), n_tokens=cu[-1])


def make_flash_views(cu_seqlens: torch.Tensor, prefix_index: torch.Tensor | None = None) -> VarlenPlan:
    """A plan for a varlen kernel: no buckets, no padding, keys gathered only for continuations."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    prefixes = [-1] * len(lens) if prefix_index is None else [int(x) for x in prefix_index.tolist()]
    _check_prefixes(prefixes, len(lens))
    device = cu_seqlens.device
    cu_q = torch.tensor(cu, dtype=torch.int32)
    if all(j < 0 for j in prefixes):
        views = FlashViews(cu_q=cu_q.to(device), cu_k=cu_q.to(device), max_q=max(lens, default=0),
                           max_k=max(lens, default=0), keys=None)
        return VarlenPlan(buckets=(), scatter=None, n_tokens=cu[-1], flash=views)
    ranges, key_lens = [], []
    for s, j in enumerate(prefixes):
        if j >= 0:
            ranges.append(torch.arange(cu[j], cu[j + 1], dtype=torch.int64))
        ranges.append(torch.arange(cu[s], cu[s + 1], dtype=torch.int64))
        key_lens.append(lens[s] + (lens[j] if j >= 0 else 0))
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(torch.tensor(key_lens, dtype=torch.int32), 0)
    views = FlashViews(cu_q=cu_q.to(device), cu_k=cu_k.to(device), max_q=max(lens), max_k=max(key_lens),
                       keys=torch.cat(ranges).to(device))
    return VarlenPlan(buckets=(), scatter=None, n_tokens=cu[-1], flash=views)
