"""The static decode step and the graph runner's bookkeeping, on CPU (no capture).

The static step (engines/static_decode.py) must give the eager step's logits and tokens, row
by row, through prefill, n-sample expansion, compaction and padding to a batch bucket; the
runner must key, reuse and drop graphs as its docstring says. The capture/replay calls
themselves need CUDA: tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines import decode_graphs as dg
from rlpipe.engines import qwen3_fast, qwen3_moe
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.decode_loop import generate_batch, left_pad
from rlpipe.engines.torch_engine import FastBackend, TorchEngine
from rlpipe.models.presets import build_model
from rlpipe.tasks.build import (
    make_engines,  # imported here: importing Prefect resets logging handlers
)
from rlpipe.tasks.config import RunConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

VOCAB = 64
CPU = torch.device("cpu")


def model_of(preset: str, seed: int = 0, tied: bool = False):
    """A tiny preset with a scaled-up lm_head: peaked next-token distributions, so greedy
    choices are not near-ties that float rounding could flip."""
    model = build_model(preset, VOCAB, seed=seed, tie_word_embeddings=tied)
    if not tied:
        with torch.no_grad():
            model.lm_head.weight.mul_(8)
    return model.eval()


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def static_backend(weights, max_rows: int = 8, span_chunk: int = 4) -> dg.GraphBackend:
    graphs = dg.DecodeGraphs(max_rows, capture=False, span_chunk=span_chunk)
    graphs.bind(weights)
    return dg.GraphBackend(graphs)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_static_step_equals_eager_step_through_expansion_compaction_and_padding(preset):
    weights = qwen3_fast.QwenWeights.from_model(model_of(preset))
    tokens, pad = left_pad([tuple(p) for p in prompts_of([9, 3, 6])], CPU)
    eager, static = FastBackend(weights), static_backend(weights)
    with torch.inference_mode():
        logits_e = eager.start(tokens, pad, 9 + 14)
        logits_s = static.start(tokens, pad, 9 + 14)
        torch.testing.assert_close(logits_s, logits_e)
        expand = torch.tensor([0, 0, 1, 2, 2])  # two samples of prompts 0 and 2: 5 rows, bucket 8
        eager.select(expand), static.select(expand)
        logits_e, logits_s = logits_e[expand], logits_s[expand]
        positions = torch.tensor([9, 9, 3, 6, 6])
        for t in range(12):  # spans 12, 16, 20: the attended width grows past chunk edges
            token = logits_e.argmax(-1)
            assert torch.equal(logits_s.argmax(-1), token), t
            if t == 5:  # rows 1 and 2 finish: 3 rows left, bucket 4 (one padding row)
                keep = torch.tensor([0, 3, 4])
                eager.select(keep), static.select(keep)
                token, positions = token[keep], positions[keep]
            logits_e = eager.step(token, positions)
            logits_s = static.step(token, positions).clone()
            torch.testing.assert_close(logits_s, logits_e, atol=1e-4, rtol=1e-5)
            positions = positions + 1
    assert static.rows == 3 and static.length == 9 + 12


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("greedy", [True, False])
def testgenerate_batch_static_equals_eager_with_rows_finishing_early(preset, greedy):
    model = model_of(preset)
    weights = qwen3_fast.QwenWeights.from_model(model)
    prompts = prompts_of([7, 2, 11, 4, 4, 9])
    # stop tokens chosen from what the model emits, so that rows end at different steps
    params = SamplingParams(n=1, max_new_tokens=16, seed=3, greedy=greedy)
    probe = generate_batch(FastBackend(weights), prompts, params, torch.Generator().manual_seed(3), CPU)
    stops = sorted({c.tokens[k] for c, k in zip(probe, (3, 6, 9, 12, 1, 14), strict=True)})
    params = SamplingParams(n=1, max_new_tokens=16, seed=3, greedy=greedy, stop_token_ids=stops)

    def run(backend):
        with torch.inference_mode():
            return generate_batch(backend, prompts, params, torch.Generator().manual_seed(3), CPU)

    eager, static = run(FastBackend(weights)), run(static_backend(weights, span_chunk=8))
    lengths = [len(c.tokens) for c in eager]
    assert len(set(lengths)) > 2 and "stop" in {c.finish_reason for c in eager}, lengths
    for e, s in zip(eager, static, strict=True):
        assert s.tokens == e.tokens and s.finish_reason == e.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=1e-5)


def test_samples_of_one_prompt_static_equals_eager():
    weights = qwen3_fast.QwenWeights.from_model(model_of("tiny-dense"))
    prompts = [p for p in prompts_of([5, 8]) for _ in range(3)]  # n = 3: one prefill per prompt
    params = SamplingParams(max_new_tokens=10, seed=0, temperature=1.0)
    with torch.inference_mode():
        eager = generate_batch(FastBackend(weights), prompts, params, torch.Generator().manual_seed(0), CPU)
        static = generate_batch(static_backend(weights), prompts, params, torch.Generator().manual_seed(0), CPU)
    assert [c.tokens for c in static] == [c.tokens for c in eager]
    assert len({tuple(c.tokens) for c in eager}) > 2  # the samples differ from each other


def test_batch_buckets_and_choice():
    assert dg.batch_buckets(1) == [1]
    assert dg.batch_buckets(8) == [1, 2, 4, 8]
    assert dg.batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    buckets = dg.batch_buckets(100)
    assert [dg.bucket_for(n, buckets) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    with pytest.raises(ValueError, match="101 rows"):
        dg.bucket_for(101, buckets)
    with pytest.raises(ValueError, match="max_rows"):
        dg.batch_buckets(0)


def test_compaction_only_when_a_smaller_graph_fits():
    buckets = dg.batch_buckets(64)
    assert not dg.worth_compacting(64, 33, buckets)  # 33 live still need the 64 graph
    assert dg.worth_compacting(64, 32, buckets)
    assert not dg.worth_compacting(40, 33, buckets)  # both bucket 64
    assert dg.worth_compacting(5, 4, buckets)
    assert not dg.worth_compacting(5, 0, buckets)  # nothing left: the loop ends instead


def test_span_and_capacity_round_up_to_chunks():
    assert [dg.span_for(n, 4, 20) for n in (1, 4, 5, 17, 20)] == [4, 4, 8, 20, 20]
    assert dg.span_for(19, 8, 20) == 20  # never past the cache
    assert [dg.capacity_for(n, 8) for n in (1, 8, 9)] == [8, 8, 16]


def test_clone_keeps_tied_weights_shared_and_copy_refreshes_in_place():
    model = model_of("tiny-dense", tied=True)  # tied embeddings: embed and lm_head are one tensor
    weights = qwen3_fast.QwenWeights.from_model(model)
    assert weights.embed.data_ptr() == weights.lm_head.data_ptr()
    static = dg.clone_weights(weights)
    assert static.embed is static.lm_head and static.embed.data_ptr() != weights.embed.data_ptr()
    buffers = [t.data_ptr() for t in dg._leaves(static) if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    fresh = qwen3_fast.QwenWeights.from_model(model)
    dg.copy_weights_(static, fresh)
    assert [t.data_ptr() for t in dg._leaves(static) if isinstance(t, torch.Tensor)] == buffers
    for s, f in zip(dg._leaves(static), dg._leaves(fresh), strict=True):
        if isinstance(s, torch.Tensor):
            assert torch.equal(s, f)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay reruns the step into the captured output."""

    def __init__(self, runner: dg.DecodeGraphs, batch: int, span: int, out: torch.Tensor):
        self.runner, self.batch, self.span, self.out, self.replays = runner, batch, span, out, 0

    def replay(self):
        self.out.copy_(self.runner._step(self.batch, self.span))
        self.replays += 1


def fake_capture(monkeypatch) -> None:
    def capture(self, batch, span):
        self.captures += 1
        out = self._step(batch, span).clone()
        return FakeGraph(self, batch, span, out), out

    monkeypatch.setattr(dg.DecodeGraphs, "_capture", capture)


def test_graphs_are_keyed_by_bucket_and_span_reused_and_dropped_on_growth(monkeypatch):
    fake_capture(monkeypatch)
    model = model_of("tiny-moe")
    runner = dg.DecodeGraphs(8, capture=True, span_chunk=8)
    params = SamplingParams(max_new_tokens=10, seed=0, greedy=True)
    prompts = prompts_of([5, 3, 6])
    with torch.inference_mode():
        runner.bind(qwen3_fast.QwenWeights.from_model(model))
        first = generate_batch(dg.GraphBackend(runner), prompts, params, torch.Generator(), CPU)
        # 3 rows -> bucket 4; columns 7..15 attended -> spans 8 and 16
        assert sorted(runner.graphs) == [(4, 8), (4, 16)] and runner.captures == 2
        eager = generate_batch(FastBackend(qwen3_fast.QwenWeights.from_model(model)), prompts, params,
                                torch.Generator(), CPU)
        assert [c.tokens for c in first] == [c.tokens for c in eager]
        runner.bind(qwen3_fast.QwenWeights.from_model(model))
        generate_batch(dg.GraphBackend(runner), prompts, params, torch.Generator(), CPU)
        assert runner.captures == 2  # same buckets and capacity: reused
        assert sum(graph.replays for graph, _ in runner.graphs.values()) == 2 * 9
        runner.bind(qwen3_fast.QwenWeights.from_model(model))
        generate_batch(dg.GraphBackend(runner), prompts, SamplingParams(max_new_tokens=30, greedy=True),
                        torch.Generator(), CPU)
        assert runner.capacity == 40  # grew to 6 + 30 columns, rounded up to the chunk
        assert (4, 8) in runner.graphs and runner.captures == 2 + 5  # all recaptured over the new cache


def test_engine_sees_weights_updated_in_place_between_generate_calls(monkeypatch):
    """What a training step does (in-place optimizer updates): the next generate must sample
    from the new weights although the runner keeps its own copy of them."""
    fake_capture(monkeypatch)
    model = model_of("tiny-dense")
    engine = TorchEngine(model, max_batch_size=8)
    engine._graphs = dg.DecodeGraphs(8, capture=True, span_chunk=8)  # what cuda_graphs=True sets on CUDA
    prompts, params = prompts_of([4, 6]), SamplingParams(max_new_tokens=8, greedy=True, n=2)
    before = engine.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = engine.generate(prompts, params)
    reference = TorchEngine(model).generate(prompts, params)  # eager, fresh
    assert [[c.tokens for c in g] for g in after] == [[c.tokens for c in g] for g in reference]
    assert [[c.tokens for c in g] for g in after] != [[c.tokens for c in g] for g in before]
    for g_after, g_ref in zip(after, reference, strict=True):
        for a, r in zip(g_after, g_ref, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=1e-5)
    engine.close()
    assert engine._graphs.weights is None and not engine._graphs.graphs


def test_cuda_graphs_key_is_ignored_off_cuda_with_one_log_line(caplog):
    model = model_of("tiny-dense")
    with caplog.at_level("INFO", logger="rlpipe.engines.torch_engine"):
        engine = TorchEngine(model, cuda_graphs=True)
    assert engine._graphs is None
    assert [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()] == [
        "engine.cuda_graphs ignored (device cpu is not CUDA): decoding eagerly"]
    out = engine.generate(prompts_of([3]), SamplingParams(max_new_tokens=4, greedy=True))
    assert len(out[0][0].tokens) == 4


def test_bind_reallocates_on_a_new_weight_layout(monkeypatch):
    fake_capture(monkeypatch)
    runner = dg.DecodeGraphs(4, capture=True, span_chunk=8)
    with torch.inference_mode():
        runner.bind(qwen3_fast.QwenWeights.from_model(model_of("tiny-dense")))
        runner.reserve(10)
        backend = dg.GraphBackend(runner)
        tokens, pad = left_pad([(3, 4, 5)], CPU)
        backend.start(tokens, pad, 10)
        backend.step(torch.tensor([7]), torch.tensor([3]))
        assert runner.graphs
        runner.bind(qwen3_fast.QwenWeights.from_model(model_of("tiny-moe")))
    assert not runner.graphs and runner.cache is None
    assert isinstance(runner.weights.layers[0].mlp, qwen3_moe.MoeMLP)


def test_layout_tells_tied_from_untied_weights():
    tied = qwen3_fast.QwenWeights.from_model(model_of("tiny-dense", tied=True))
    # the same tensors cast to another dtype are no longer one: a copy into the tied buffer
    # would write embed and lm_head into one tensor
    cast = qwen3_fast.QwenWeights.from_model(model_of("tiny-dense", tied=True), dtype=torch.float64)
    assert dg.layout(tied) == dg.layout(dg.clone_weights(tied))
    assert dg.layout(dg.clone_weights(tied)) != dg.layout(qwen3_fast.QwenWeights.from_model(model_of("tiny-dense")))
    assert cast.embed.data_ptr() != cast.lm_head.data_ptr()
    assert [x[3] for x in dg.layout(cast) if isinstance(x, tuple)] != [
        x[3] for x in dg.layout(tied) if isinstance(x, tuple)]


def test_stale_cache_columns_from_an_earlier_call_do_not_leak():
    """Masked columns still enter the attention sums (as 0 x value): start() must clear what
    an earlier call left there (here NaN, as an overflowed earlier call would leave)."""
    weights = qwen3_fast.QwenWeights.from_model(model_of("tiny-dense"))
    backend = static_backend(weights, span_chunk=16)
    params = SamplingParams(max_new_tokens=6, seed=0, temperature=1.0)
    prompts = prompts_of([3, 5])
    with torch.inference_mode():
        generate_batch(backend, prompts, params, torch.Generator(), CPU)
        for t in backend.graphs.cache.k + backend.graphs.cache.v:
            t.fill_(float("nan"))
        static = generate_batch(dg.GraphBackend(backend.graphs), prompts, params, torch.Generator(), CPU)
        eager = generate_batch(FastBackend(weights), prompts, params, torch.Generator(), CPU)
    assert [c.tokens for c in static] == [c.tokens for c in eager]
    assert all(torch.tensor(c.logprobs).isfinite().all() for c in static)


def test_config_key_reaches_the_rl_engine(caplog):
    config = RunConfig.model_validate({"device": "cpu", "engine": {"cuda_graphs": True}})
    assert config.engine.cuda_graphs and not RunConfig().engine.cuda_graphs
    with caplog.at_level("INFO", logger="rlpipe.engines.torch_engine"):
        (engine,) = make_engines(config, model_of("tiny-dense"))
    assert isinstance(engine, TorchEngine) and engine._graphs is None
    assert any("engine.cuda_graphs ignored" in r.getMessage() for r in caplog.records)


class OpLog(TorchDispatchMode):
    """Every aten op run, with its output shapes: what a CUDA graph would record."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


def _logged_steps(backend, weights, steps: int) -> list[list[tuple[str, tuple]]]:
    tokens, pad = left_pad([tuple(p) for p in prompts_of([6, 3, 5])], CPU)
    logs = []
    with torch.inference_mode():
        logits = backend.start(tokens, pad, 6 + steps)
        positions = torch.tensor([6, 3, 5])
        for _ in range(steps):
            token = logits.argmax(-1)
            with OpLog() as log:
                logits = backend.step(token, positions)
            logs.append(log.ops)
            positions = positions + 1
    return logs


def test_static_step_runs_the_same_ops_on_the_same_shapes_every_step():
    """What capture needs, checked without CUDA: one op sequence with fixed shapes, and no
    value read back to the host (`_local_scalar_dense` is what .item() and friends run)."""
    weights = qwen3_fast.QwenWeights.from_model(model_of("tiny-moe"))
    logs = _logged_steps(static_backend(weights, span_chunk=16), weights, steps=6)  # one span
    step_ops = [[op for op in log if "copy_" not in op[0] and "fill_" not in op[0]] for log in logs]
    assert all(ops == step_ops[0] for ops in step_ops)
    assert not [op for log in logs for op in log if "_local_scalar_dense" in op[0] or "nonzero" in op[0]]
    # the checker can fail: the eager MoE step's expert slices change with the routing
    eager = _logged_steps(FastBackend(weights), weights, steps=6)
    assert any(log != eager[0] for log in eager[1:])
