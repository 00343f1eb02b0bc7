"""CUDA graphs for the torch engine's decode (engines/decode_graphs.py): what only a GPU can show.

The CPU tests (tests/unit/test_decode_graphs.py) check the static step against the eager one and
the runner's bookkeeping with a stand-in graph; these check the real capture and replay.
Skipped with the reason where torch sees no CUDA device. Run: `python -m pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines import decode_graphs as dg
from rlpipe.engines import qwen3_fast
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.decode_loop import left_pad
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.presets import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]
VOCAB = 97
CUDA = torch.device("cuda")


def _model(preset: str, seed: int = 1):
    """An untied preset with a scaled lm_head (peaked distributions: greedy has no near-ties)."""
    model = build_model(preset, VOCAB, seed=seed, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model.to(CUDA)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _tokens(out) -> list[list[list[int]]]:
    return [[c.tokens for c in group] for group in out]


@pytest.mark.parametrize("preset", ["small-dense", "small-moe"])
def test_graph_replay_equals_eager_decode(preset):
    model = _model(preset)
    prompts = _prompts([5, 40, 17, 90, 3, 61])
    params = SamplingParams(n=3, max_new_tokens=300, greedy=True, stop_token_ids=(7, 11, 13))
    eager = TorchEngine(model, max_batch_size=32).generate(prompts, params)
    engine = TorchEngine(model, max_batch_size=32, cuda_graphs=True)
    graphed = engine.generate(prompts, params)
    assert engine._graphs is not None and engine._graphs.captures >= 1
    assert _tokens(graphed) == _tokens(eager)
    for g_graph, g_eager in zip(graphed, eager, strict=True):
        for a, b in zip(g_graph, g_eager, strict=True):
            assert a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    captures = engine._graphs.captures
    assert _tokens(engine.generate(prompts, params)) == _tokens(eager)
    assert engine._graphs.captures == captures  # the second call replays the same graphs


def test_bf16_graph_replay_stays_close_to_eager():
    model = _model("small-dense")
    prompts = _prompts([12, 30, 7, 50])
    params = SamplingParams(n=4, max_new_tokens=64, greedy=True)
    eager = TorchEngine(model, dtype=torch.bfloat16).generate(prompts, params)
    graphed = TorchEngine(model, dtype=torch.bfloat16, cuda_graphs=True).generate(prompts, params)
    pairs = [(a, b) for ga, gb in zip(graphed, eager, strict=True) for a, b in zip(ga, gb, strict=True)]
    same = sum(a.tokens == b.tokens for a, b in pairs)
    assert same >= 0.75 * len(pairs), (same, len(pairs))  # bf16 rounding may flip a late near-tie
    for a, b in pairs:  # up to the first difference, the same distributions
        agree = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), len(a.tokens))
        torch.testing.assert_close(torch.tensor(a.logprobs[:agree]), torch.tensor(b.logprobs[:agree]),
                                   atol=5e-2, rtol=0)


def test_replayed_logits_equal_the_uncaptured_static_step():
    weights = qwen3_fast.QwenWeights.from_model(_model("small-moe"))
    tokens, pad = left_pad([tuple(p) for p in _prompts([9, 4, 6])], CUDA)
    logits = []
    with torch.inference_mode():
        for capture in (False, True):
            graphs = dg.DecodeGraphs(4, capture=capture, span_chunk=8)
            graphs.bind(weights)
            backend = dg.GraphBackend(graphs)
            out, steps = backend.start(tokens, pad, 9 + 20), []
            positions = torch.tensor([9, 4, 6], device=CUDA)
            for _ in range(20):
                out = backend.step(out.argmax(-1), positions).clone()
                positions += 1
                steps.append(out)
            logits.append(torch.stack(steps))
    assert graphs.captures == 3  # spans 16, 24, 32 at bucket 4
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_replayed_steps_never_wait_for_the_gpu():
    weights = qwen3_fast.QwenWeights.from_model(_model("small-dense"))
    tokens, pad = left_pad([tuple(p) for p in _prompts([9, 4])], CUDA)
    with torch.inference_mode():
        graphs = dg.DecodeGraphs(2, capture=True, span_chunk=64)
        graphs.bind(weights)
        backend = dg.GraphBackend(graphs)
        logits = backend.start(tokens, pad, 40)
        positions = torch.tensor([9, 4], device=CUDA)
        logits = backend.step(logits.argmax(-1), positions)  # captures (capture itself syncs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                positions = positions + 1
                logits = backend.step(logits.argmax(-1), positions)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert graphs.captures == 1


def test_weights_updated_by_a_training_step_are_seen_by_the_next_generate():
    from rlpipe.training.batch import Sequence, pack
    from rlpipe.training.losses import nll_loss
    from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

    model = _model("small-dense")
    prompts = _prompts([8, 20, 5])
    params = SamplingParams(n=2, max_new_tokens=32, greedy=True)
    engine = TorchEngine(model, max_batch_size=8, cuda_graphs=True)
    before = engine.generate(prompts, params)
    captures = engine._graphs.captures
    optimizer = build_optimizer(model, lr=1e-2)
    target = [Sequence(tokens=p + [5] * 16, weights=[1.0] * (len(p) + 16), sample_id=str(i))
              for i, p in enumerate(prompts)]
    model.train()
    for _ in range(3):
        forward_backward(model, pack(target, 4096), nll_loss, StepOptions(autocast=False))
        optim_step(model, optimizer, None, max_grad_norm=1.0)
    after = engine.generate(prompts, params)
    reference = TorchEngine(model, max_batch_size=8).generate(prompts, params)
    assert _tokens(after) == _tokens(reference) != _tokens(before)
    assert engine._graphs.captures == captures  # same graphs, new weights copied into their buffers
