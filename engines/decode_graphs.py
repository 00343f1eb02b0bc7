"""CUDA graphs for the torch engine's decode steps (`engine.cuda_graphs`).

Why: at decode a small model is bound by kernel launches, not arithmetic (Qwen3-0.6B: 28
layers x ~15 kernels per token step, each far shorter than its launch). A CUDA graph replays
the whole step as one launch. It needs a step with fixed shapes and fixed memory addresses:
`engines.static_decode.decode_static`, over the buffers this module keeps:

- weights: a private copy of the engine's `QwenWeights`, refreshed IN PLACE at each generate.
  The engine rebuilds its weights every call (`QwenWeights.from_model` fuses q/k/v and gate/up
  into new tensors), so a graph captured on those would read freed memory on the next call.
  Copying into fixed buffers costs one device copy of the weights per generate call (0.6B in
  bf16: 1.2 GB read and written, about a millisecond at a GPU's memory bandwidth of 1-3 TB/s, less
  than `from_model` itself takes; bench_gpu measures both); recapturing instead would cost at least
  one eager step plus the capture per graph, several graphs a call (docs/BENCHMARKS_GPU.md has
  the eager step's time).
- the KV cache, RoPE tables and step inputs, sized for `max_rows` rows and a column capacity
  that only grows (rounded up to `span_chunk`); growing it reallocates and drops the graphs.
  They stay allocated between generate calls (that is what lets graphs be reused): the
  engine's largest cache is held while the trainer trains. `close()` releases it all.

Graphs are keyed by (batch bucket, span): batch buckets are powers of two up to `max_rows`;
the span is the attended cache width, rounded up to `span_chunk` columns.

Finished rows: the engine already compacts its batch (drops finished rows); here a batch of n
live rows runs the graph of the smallest bucket >= n, its extra rows padding whose outputs are
ignored. The alternative, keeping finished rows masked in one full-size graph, would make every
step of a long tail cost the full batch, which is what compaction exists to avoid. So compaction
happens only when it drops the batch to a smaller bucket (`worth_compacting`): before that it
would copy the cache and run the same graph.

On CPU the same static step runs without capture, for tests; the engine ignores the key there,
since fixed shapes cost more than launches save: uncaptured, the static step decoded at 0.74x
(small-dense) and 0.56x (small-moe) the eager step's tokens/s (`python -m benchmarks.bench_engine`,
64 rows x 128 tokens, a small CPU at load 3.4).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from rlpipe.engines import qwen3_fast
from rlpipe.engines.qwen3_fast import KVCache, QwenWeights
from rlpipe.engines.static_decode import StepInputs, decode_static

SPAN_CHUNK = 256


def batch_buckets(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, ... below max_rows, then max_rows."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return [1 << i for i in range(max(0, math.ceil(math.log2(max_rows))))] + [max_rows]


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding `rows` rows."""
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest batch bucket {buckets[-1]}")


def worth_compacting(rows: int, live: int, buckets: list[int]) -> bool:
    """Drop finished rows only when the live ones fit a smaller graph."""
    return 0 < live and bucket_for(live, buckets) < bucket_for(rows, buckets)


def span_for(filled: int, chunk: int, capacity: int) -> int:
    """Cache columns a step attends to when `filled` of them hold keys (this step's included)."""
    return min(capacity, chunk * math.ceil(filled / chunk))


def capacity_for(columns: int, chunk: int) -> int:
    return chunk * math.ceil(columns / chunk)


def clone_weights(weights: QwenWeights) -> QwenWeights:
    """A copy in fresh buffers; tensors shared in `weights` (tied embeddings) stay shared."""
    memo: dict[tuple, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
        if key not in memo:
            memo[key] = t.clone(memory_format=torch.contiguous_format)
        return memo[key]

    return _map_tensors(weights, clone)


def copy_weights_(dst: QwenWeights, src: QwenWeights) -> None:
    """Copy src's values into dst's buffers (same layout: see `layout`)."""
    done: set[int] = set()
    for d, s in zip(_leaves(dst), _leaves(src), strict=True):
        if isinstance(d, torch.Tensor) and id(d) not in done:
            d.copy_(s)
            done.add(id(d))


def layout(weights: QwenWeights) -> tuple:
    """What must match for `copy_weights_`: shapes, dtypes, devices, which tensors are one
    (tied embeddings), and the scalar fields."""
    first: dict[tuple, int] = {}
    out = []
    for i, x in enumerate(_leaves(weights)):
        if isinstance(x, torch.Tensor):
            alias = first.setdefault((x.data_ptr(), x.shape, x.stride(), x.dtype), i)
            out.append((tuple(x.shape), x.dtype, x.device, alias))
        else:
            out.append(x)
    return tuple(out)


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


def _leaves(obj) -> list:
    if isinstance(obj, list):
        return [x for o in obj for x in _leaves(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))]
    return [obj]


class DecodeGraphs:
    """Static buffers and the graphs captured over them, kept across generate calls.

    capture: record CUDA graphs (needs a CUDA device); False runs the static step eagerly.
    """

    def __init__(self, max_rows: int, capture: bool, span_chunk: int = SPAN_CHUNK) -> None:
        self.buckets = batch_buckets(max_rows)
        self.capture = capture
        self.span_chunk = span_chunk
        self.weights: QwenWeights | None = None
        self.cache: KVCache | None = None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.inputs: StepInputs | None = None
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.captures = 0
        """Graphs captured so far (tests and benchmarks read it)."""
        self._pool = None

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.key_bias.shape[1]

    def bind(self, weights: QwenWeights) -> None:
        """Take `weights`' current values: copied into the static buffers, which are
        (re)allocated, dropping the graphs, only on the first call or a layout change."""
        if self.weights is not None and layout(self.weights) == layout(weights):
            copy_weights_(self.weights, weights)
            return
        self.release()
        self.weights = clone_weights(weights)
        self.inputs = StepInputs.empty(self.buckets[-1], weights.device)

    def reserve(self, columns: int) -> None:
        """Room for `columns` cache columns (the cache grows by whole chunks, dropping graphs)."""
        assert self.weights is not None, "bind() first"
        if columns > self.capacity:
            self.graphs.clear()
            self.cache = None  # free the old cache before allocating the new one
            capacity = capacity_for(columns, self.span_chunk)
            self.cache = KVCache.empty(self.weights, self.buckets[-1], capacity)
            self.rope = qwen3_fast.rope_tables(self.weights, capacity)
        else:  # the weights' rotary frequencies may have been replaced: rewrite in place
            for static, fresh in zip(self.rope, qwen3_fast.rope_tables(self.weights, self.capacity), strict=True):
                static.copy_(fresh)

    def run(self, rows: int, filled: int) -> torch.Tensor:
        """One static step over `rows` live rows with `filled` cache columns attended (inputs
        already written). Returns logits [rows, V]: a view that the next run overwrites."""
        batch = bucket_for(rows, self.buckets)
        span = span_for(filled, self.span_chunk, self.capacity)
        if not self.capture:
            return self._step(batch, span)[:rows]
        if (batch, span) not in self.graphs:
            self.graphs[(batch, span)] = self._capture(batch, span)
        graph, out = self.graphs[(batch, span)]
        graph.replay()
        return out[:rows]

    def release(self) -> None:
        """Drop graphs and buffers (the engine's `close`, or a new weight layout)."""
        self.graphs.clear()
        self.weights = self.cache = self.rope = self.inputs = None
        self._pool = None

    def _step(self, batch: int, span: int) -> torch.Tensor:
        assert self.weights is not None and self.cache is not None and self.rope is not None
        return decode_static(self.weights, self.cache, self.rope, self.inputs, batch, span)

    def _capture(self, batch: int, span: int) -> tuple[object, torch.Tensor]:
        """torch's recipe: warm up on a side stream, then record on the capture stream. The
        warm-up runs the real step on the current inputs: it writes this step's K/V, which the
        replay right after rewrites with the same values."""
        device = self.weights.device
        with torch.cuda.device(device):
            if self._pool is None:
                # one pool for all graphs: each one's output is read before the next replays
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(batch, span)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (an async trainer) may run meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._step(batch, span)
        self.captures += 1
        return graph, out


class GraphBackend:
    """The torch engine's `Backend` over `DecodeGraphs`: eager prefill into the static cache,
    then one static (captured) step per token."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs
        self.rows = 0
        self.length = 0

    def start(self, tokens: torch.Tensor, pad: torch.Tensor, max_len: int) -> torch.Tensor:
        g = self.graphs
        g.reserve(max_len)
        width = tokens.shape[1]
        # the cache holds an earlier call's keys, and a masked column still enters the attention
        # sums as 0 x value (a stale inf or NaN would leak): zero it all, as KVCache.empty does
        # (prefill leaves the columns left of a short prompt's length bucket unwritten). One
        # memset of the cache per batch, about what one late decode step reads.
        for t in (*g.cache.k, *g.cache.v, g.cache.key_bias):
            t.zero_()
        view = _rows_view(g.cache, tokens.shape[0])
        logits = qwen3_fast.prefill(g.weights, tokens, pad, view, g.rope)
        self.rows, self.length = tokens.shape[0], width
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Gather `rows` into the first len(rows) cache rows (the filled columns)."""
        cache, n = self.graphs.cache, self.length
        if len(rows) > len(cache.key_bias):
            raise ValueError(f"{len(rows)} rows exceed the {len(cache.key_bias)} the graphs were sized for")
        for k, v in zip(cache.k, cache.v, strict=True):
            k[: len(rows), ..., :n] = k[: self.rows, ..., :n][rows]
            v[: len(rows), :, :n] = v[: self.rows, :, :n][rows]
        cache.key_bias[: len(rows)] = cache.key_bias[: self.rows][rows]
        self.rows = len(rows)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert len(tokens) == self.rows, (len(tokens), self.rows)
        inputs = self.graphs.inputs
        inputs.tokens[: self.rows].copy_(tokens)
        inputs.positions[: self.rows].copy_(positions)
        inputs.column.fill_(self.length)
        self.length += 1
        return self.graphs.run(self.rows, self.length)

    def worth_compacting(self, rows: int, live: int) -> bool:
        return worth_compacting(rows, live, self.graphs.buckets)


def _rows_view(cache: KVCache, rows: int) -> KVCache:
    return KVCache(k=[t[:rows] for t in cache.k], v=[t[:rows] for t in cache.v], length=0,
                   key_bias=cache.key_bias[:rows])
