"""Fast by default: `train.compile` resolved from the device (models/compile.py, tasks/setup.py),
`train.fused` (training/fused.py), and the chunked linear + log-prob path against the unfused one
(full [tokens, vocab] logits) for a weighted, tempered loss through a whole model.

Liger's own kernels need CUDA: tests/gpu/test_cuda.py checks them against the unpatched model."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.models.attention import packed_logits
from rlpipe.models.compile import compile_enabled, compile_seconds, is_compiled
from rlpipe.models.presets import build_model
from rlpipe.tasks.config import load_config, validate_config
from rlpipe.tasks.setup import place_model, placement, with_resolved_compile
from rlpipe.tasks.step_rows import step_metrics
from rlpipe.training import fused
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.fused import apply_fused_kernels, resolve_fused
from rlpipe.training.logprobs import token_logprobs

ROOT = Path(__file__).resolve().parents[2]


def test_compile_is_on_for_cuda_and_off_on_the_cpu_unless_set():
    assert compile_enabled(None, "cuda") is True
    assert compile_enabled(None, "cpu") is False
    assert compile_enabled(None, "cuda", activation_checkpointing=True) is False
    assert compile_enabled(True, "cpu") is True
    assert compile_enabled(False, "cuda") is False


def test_the_run_config_records_what_compile_resolved_to():
    unset = validate_config({"device": "cpu"})
    assert unset.train.compile is None  # unset = auto is a value of its own
    resolved = with_resolved_compile(unset)
    assert resolved.train.compile is False and not placement(resolved).compile
    assert validate_config(resolved.model_dump(mode="json")) == resolved  # config.json validates again
    assert with_resolved_compile(validate_config({"device": "cpu", "train": {"compile": True}})).train.compile
    with pytest.raises(ConfigError, match="train.compile with train.activation_checkpointing"):
        validate_config({"train": {"compile": True, "activation_checkpointing": True}})


def test_a_flow_logs_the_resolved_compile_value(tmp_path):
    from rlpipe.flows.common import resolve_config

    config = resolve_config(str(ROOT / "configs" / "tiny.toml"), [f"runs_root={tmp_path}", "device=cpu"], None)
    assert config.train.compile is False
    assert json.loads(config.model_dump_json())["train"]["compile"] is False


def test_gpu_toml_compiles_by_default_on_cuda():
    gpu = load_config(ROOT / "configs" / "gpu.toml")
    assert gpu.device == "cuda" and gpu.train.compile is None
    assert compile_enabled(gpu.train.compile, "cuda", gpu.train.activation_checkpointing)


def test_compile_seconds_counts_what_torch_compile_spends():
    before = compile_seconds()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.randn(3))  # dynamo traces: no inductor
    assert compile_seconds() > before


def test_compile_seconds_go_to_perf_not_train():
    metrics = step_metrics({"loss": 1.0, "tokens_per_second": 5.0, "compile_seconds": 12.5}, {}, {"train": 13.0})
    assert metrics["perf/compile_seconds"] == 12.5 and "train/compile_seconds" not in metrics
    assert "perf/compile_seconds" not in step_metrics({"loss": 1.0}, {}, {"train": 1.0})


def test_fused_resolves_to_liger_only_where_it_can_run():
    assert resolve_fused("none", "cuda", "qwen3") == "none"
    assert resolve_fused("auto", "cpu", "qwen3") == "none"
    assert resolve_fused("auto", "cuda", "llama") == "none"
    with pytest.raises(ValueError, match="train.fused = 'liger': Liger Kernel's Triton kernels need CUDA"):
        resolve_fused("liger", "cpu", "qwen3")
    with pytest.raises(ValueError, match="only qwen3, qwen3_moe models"):
        resolve_fused("liger", "cuda", "llama")
    with pytest.raises(ValueError, match="train.fused must be one of"):
        resolve_fused("triton", "cpu", "qwen3")


@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_auto_picks_liger_only_for_an_eager_model_with_liger_installed(compiled, installed):
    """Measured on a GPU (docs/BENCHMARKS_GPU.md): compile + Liger 36% slower per step than compile alone, so "auto"
    never patches a compiled model; an eager one gets Liger where it is installed."""
    used = resolve_fused("auto", "cuda", "qwen3", compiled=compiled, liger_installed=installed)
    assert used == ("liger" if installed and not compiled else "none")
    assert resolve_fused("auto", "cpu", "qwen3", compiled=compiled, liger_installed=installed) == "none"


def test_liger_asked_for_is_honoured_under_compile_and_refused_where_missing():
    assert resolve_fused("liger", "cuda", "qwen3_moe", compiled=True, liger_installed=True) == "liger"
    with pytest.raises(ValueError, match="liger-kernel is not installed"):
        resolve_fused("liger", "cuda", "qwen3", compiled=False, liger_installed=False)


def test_fused_is_a_checked_config_field():
    assert validate_config({}).train.fused == "auto"
    with pytest.raises(ConfigError, match=r"train\.fused"):
        validate_config({"train": {"fused": "triton"}})


def test_fused_liger_on_the_cpu_is_refused_before_the_run_starts(tmp_path):
    from rlpipe.flows.common import resolve_config

    with pytest.raises(ConfigError, match=r"^train\.fused: 'liger' cannot run here: Liger Kernel's Triton"):
        resolve_config(str(ROOT / "configs" / "tiny.toml"), [f"runs_root={tmp_path}", "device=cpu",
                                                               "train.fused=liger"], None)


def test_auto_leaves_a_cpu_model_as_built():
    model = place_model(build_model("tiny-dense", vocab_size=40, seed=0), "cpu", fused="auto")
    again = build_model("tiny-dense", vocab_size=40, seed=0)
    assert apply_fused_kernels(model, "auto") == "none"
    assert not is_compiled(model)
    assert all(type(a) is type(b) for a, b in zip(model.modules(), again.modules(), strict=True))


def _batch(vocab: int):
    g = torch.Generator().manual_seed(2)
    seqs = []
    for n in (11, 19, 6):
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        weights = torch.linspace(-1.5, 2.0, n).tolist()  # signed per-token weights, as advantages give
        seqs.append(Sequence(tokens=tokens, weights=weights))
    (batch,) = pack(seqs, token_budget=64)
    return batch


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprob_loss_and_gradients_equal_the_unfused_path(tied):
    """The policy-gradient-shaped loss sum(w * logp) at temperature 0.7: rlpipe's chunked linear +
    log-softmax (never a [T, V] tensor) against log_softmax of the model's full logits."""
    vocab, temperature = 64, 0.7
    model = build_model("tiny-dense", vocab_size=vocab, seed=4, tie_word_embeddings=tied)
    batch = _batch(vocab)
    weights = batch.token_weights.float()

    logp, _ = token_logprobs(model, batch, temperature=temperature, chunk_size=5)
    loss = -(weights * logp).sum()
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = packed_logits(model, batch).float() / temperature
    full = torch.log_softmax(logits, -1).gather(1, batch.labels.clamp(min=0)[:, None]).squeeze(1)
    full = torch.where(batch.labels != -100, full, torch.zeros_like(full))
    reference = -(weights * full).sum()
    reference.backward()

    torch.testing.assert_close(logp, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("preset, model_type, swiglu", [("tiny-dense", "qwen3", True), ("tiny-moe", "qwen3_moe", False)])
def test_liger_patches_swiglu_in_a_dense_qwen3_and_leaves_moe_experts_to_transformers(monkeypatch, preset,
                                                                                     model_type, swiglu):
    """Liger's fused MoE experts did not match the unpatched ones on a GPU: a MoE keeps its experts."""
    calls = []
    liger = types.ModuleType("liger_kernel.transformers")
    setattr(liger, fused.LIGER_PATCHES[model_type], lambda **kwargs: calls.append(kwargs))
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger)
    monkeypatch.setattr(fused, "resolve_fused", lambda *a, **k: "liger")
    model = build_model(preset, vocab_size=32, seed=0)
    assert model.config.model_type == model_type
    assert fused.apply_fused_kernels(model, "liger") == "liger"
    assert len(calls) == 1 and calls[0]["model"] is model
    assert (calls[0]["swiglu"], calls[0]["rms_norm"], calls[0]["rope"]) == (swiglu, True, True)
    assert not calls[0]["fused_linear_cross_entropy"] and not calls[0]["cross_entropy"]
