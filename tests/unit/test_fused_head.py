"""`train.logprobs` (training/fused_head.py): which head runs where, and that the setting reaches
the LM head from the config through a train step. Cut Cross-Entropy's kernels are Triton (CUDA
only; the package does not import without Triton), so its equality with the chunked head is
tests/gpu/test_cuda.py `test_fused_head_gives_the_chunked_log_probs_and_gradients`."""

from __future__ import annotations

import logging

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.models.presets import build_model
from rlpipe.tasks.build import rl_plan, supervised_plan
from rlpipe.tasks.config import validate_config
from rlpipe.training import fused_head, logprobs
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.fused_head import resolve_logprobs
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import StepOptions, forward_backward


@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_auto_is_the_chunked_head_which_measured_faster(device, installed):
    assert resolve_logprobs("auto", device, installed=installed) == "chunked"
    assert resolve_logprobs("chunked", device, installed=installed) == "chunked"


def test_fused_runs_where_it_can_and_else_the_chunked_head_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(fused_head, "_said", set())
    assert resolve_logprobs("fused", "cuda", installed=True) == "fused"
    with caplog.at_level(logging.WARNING, logger="rlpipe.training.fused_head"):
        assert resolve_logprobs("fused", "cpu", installed=True) == "chunked"
        assert resolve_logprobs("fused", "cpu", installed=True) == "chunked"  # said once
        assert resolve_logprobs("fused", "cuda", installed=False) == "chunked"
        assert resolve_logprobs("fused", "cuda", has_bias=True, installed=True) == "chunked"
        assert resolve_logprobs("fused", "cuda", installed=True, dtype=torch.float32) == "chunked"
        assert resolve_logprobs("fused", "cuda", installed=True, dtype=torch.float16) == "fused"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert "Triton kernels need CUDA; the model trains on cpu" in said[0]
    assert "cut-cross-entropy is not installed (pip install 'rlpipe[cce]')" in said[1]
    assert "the LM head has a bias" in said[2]
    assert "backward takes bf16 or fp16 only and this head computes in float32 (no bf16 autocast)" in said[3]
    with pytest.raises(ValueError, match="train.logprobs must be one of"):
        resolve_logprobs("cce", "cuda")


def test_the_head_matmul_dtype_is_autocasts_where_autocast_is_on():
    h, w = torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.bfloat16)
    assert fused_head.head_matmul_dtype(h, w) == torch.float32
    assert fused_head.head_matmul_dtype(h.bfloat16(), w) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_head.head_matmul_dtype(h, w.float()) == torch.bfloat16


def test_logprobs_is_a_checked_config_field_that_reaches_every_phases_step():
    assert validate_config({}).train.logprobs == "auto"
    with pytest.raises(ConfigError, match=r"train\.logprobs"):
        validate_config({"train": {"logprobs": "cce"}})
    config = validate_config({"train": {"logprobs": "fused"}})
    assert rl_plan(config).options.step.head == "fused"
    assert supervised_plan(config, "sft").options.step.head == "fused"


def _full_logprobs(hidden, weight, labels, temperature=1.0, ignore_index=-100):
    """A stand-in for Cut Cross-Entropy's kernel: the same log-probs from full [T, V] logits."""
    logp = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    picked = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels != ignore_index, picked, torch.zeros_like(picked))


@pytest.mark.parametrize("entropy", [True, False])
def test_a_step_with_the_fused_head_takes_its_log_probs_from_it(monkeypatch, entropy):
    """Where the fused head resolves, the step's log-probs come from it (here a full-logits
    stand-in on the CPU): the loss and every gradient equal the chunked head's."""
    vocab = 64
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(tokens=torch.randint(0, vocab, (n,), generator=g).tolist(), weights=[1.0] * n) for n in (9, 14)]
    batches = pack(seqs, token_budget=32)

    def step(head):
        model = build_model("tiny-dense", vocab_size=vocab, seed=3)
        options = StepOptions(temperature=0.7, entropy=entropy, head=head, chunk_size=5)
        metrics = forward_backward(model, batches, nll_loss, options)
        return metrics, {n: p.grad for n, p in model.named_parameters()}

    chunked, chunked_grads = step("fused")  # on the CPU "fused" resolves to the chunked head
    calls = []
    monkeypatch.setattr(logprobs, "resolve_logprobs", lambda head, *a, **k: "fused" if head == "fused" else "chunked")
    monkeypatch.setattr(logprobs, "fused_logprobs", lambda *a: calls.append(a) or _full_logprobs(*a))
    fused, fused_grads = step("fused")
    assert len(calls) == len(batches) and calls[0][3] == 0.7  # temperature reaches the head
    assert fused["loss"] == pytest.approx(chunked["loss"], rel=1e-6)
    if entropy:
        assert fused["entropy"] == pytest.approx(chunked["entropy"], rel=1e-6)  # entropy stays chunked
    for name, grad in chunked_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
