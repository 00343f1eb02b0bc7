"""train.compile (models/compile.py): compiled decoder layers train like eager ones.

Compiling is slow on a small CPU (~30-60 s for the first graphs, far less once inductor's
on-disk cache is warm), so the tests that run a compiled forward are few and marked slow; they
share one process-wide compiled function, so each mode (grad / no-grad) compiles once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.models.compile import compile_layers, is_compiled
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.tasks.config import validate_config
from rlpipe.tasks.setup import place_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.checkpoint_io import load_checkpoint, save_checkpoint
from rlpipe.training.kl import frozen_copy, reference_logprobs
from rlpipe.training.losses import nll_loss
from rlpipe.training.step import build_optimizer, forward_backward, optim_step
from torch._dynamo.utils import counters

VOCAB = 48


def _batches(seed: int, n: int = 10, budget: int = 64):
    """Packed micro-batches of random sequences: token counts differ between calls."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        length = int(torch.randint(4, 30, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        seqs.append(Sequence(tokens=tokens, weights=[0.0] + [1.0] * (length - 1), sample_id=f"s{i}"))
    return pack(seqs, token_budget=budget)


def _pair(**overrides):
    """(eager, compiled) tiny models with the same weights."""
    eager = place_model(build_model("tiny-dense", vocab_size=VOCAB, seed=3, **overrides), "cpu")
    compiled = place_model(build_model("tiny-dense", vocab_size=VOCAB, seed=3, **overrides), "cpu", compile=True)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far (a recompile adds to it)."""
    return int(counters["frames"]["ok"])


@pytest.mark.slow
def test_compiled_steps_match_eager_and_do_not_recompile_per_batch():
    """Losses, gradients and AdamW steps as eager; after the first step (whose micro-batches of
    two lengths made the shapes dynamic) new lengths compile nothing."""
    eager, compiled = _pair()
    optimizers = [build_optimizer(m, lr=3e-3) for m in (eager, compiled)]
    seen_lengths, frames_after_first = set(), None
    for step in range(3):
        batches = _batches(step + 1)
        if step == 0:  # static graphs, then one recompile with the token count dynamic
            assert len({b.n_tokens for b in batches}) >= 2
        seen_lengths |= {b.n_tokens for b in batches}
        metrics = [forward_backward(m, batches, nll_loss) for m in (eager, compiled)]
        assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5), step
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            optim_step(model, optimizer, max_grad_norm=1.0)
        if frames_after_first is None:
            frames_after_first = _compiled_frames()
    assert frames_after_first > 0, "nothing was compiled: the compiled path did not run"
    assert len(seen_lengths) >= 5  # micro-batches of many token counts went through
    assert _compiled_frames() == frames_after_first, "a micro-batch of a new length recompiled"
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        # the optimizer steps agree too (Adam magnifies float noise on near-zero gradients to
        # ~lr/100; a wrong gradient moves a weight by ~lr = 3e-3)
        torch.testing.assert_close(b, a, atol=3e-4, rtol=1e-3)


@pytest.mark.slow
def test_compiled_layers_trace_the_varlen_kernel_into_one_graph(monkeypatch):
    """On the flash path (CUDA's; here through a CPU kernel for the same op) a compiled layer is
    one graph, attention included: no graph break, the same losses and gradients as eager, and
    no recompile for new token counts or longest sequences once the shapes went dynamic."""
    import rlpipe.models.attention as attention

    from tests.varlen_cpu_kernel import register_cpu_varlen_kernel

    if attention.flash_kernel() is None:
        pytest.skip("this torch has no varlen kernel")
    register_cpu_varlen_kernel()
    monkeypatch.setattr(attention, "use_flash", lambda _model: True)
    eager, compiled = _pair()
    breaks_before, frames_before = sum(counters["graph_break"].values()), _compiled_frames()
    frames_after_first, longest = None, set()
    for step in range(3):
        batches = _batches(step + 20)
        longest |= {int((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).max()) for b in batches}
        metrics = [forward_backward(m, batches, nll_loss) for m in (eager, compiled)]
        assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5), step
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
        if frames_after_first is None:
            frames_after_first = _compiled_frames()
    assert frames_after_first > frames_before, "nothing was compiled: the compiled path did not run"
    assert sum(counters["graph_break"].values()) == breaks_before, dict(counters["graph_break"])
    assert len(longest) >= 3  # the kernel's max_q/max_k took several values
    assert _compiled_frames() == frames_after_first, "a micro-batch of a new length recompiled"


@pytest.mark.slow
def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights():
    """The KL reference (and the snapshot engine) deep-copy the trainer: a copy's compiled
    layers must read the copy's weights, not the trainer's as they change."""
    eager, compiled = _pair()
    batches = _batches(7)
    ref = frozen_copy(compiled)
    assert is_compiled(ref)
    with torch.no_grad():
        for param in compiled.parameters():
            param.add_(0.05)  # the trainer moves on
    expected = reference_logprobs(frozen_copy(eager), batches)
    got = reference_logprobs(ref, batches)
    moved = reference_logprobs(compiled, batches)
    for e, g, m in zip(expected, got, moved, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(m, e, atol=1e-3)


@pytest.mark.slow
def test_lora_adapters_train_the_same_compiled():
    """peft swaps the layers' Linears for LoRA ones inside the compiled layer: same gradients
    for the adapters, none for the frozen base, merged weights under the plain names."""
    from rlpipe.training.lora import LoraOptions, add_lora, merged_state_dict

    models = []
    for compile in (False, True):
        torch.manual_seed(0)  # the same random A matrices
        model = add_lora(place_model(build_model("tiny-dense", vocab_size=VOCAB, seed=3), "cpu",
                                     compile=compile), LoraOptions(rank=4))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # B starts at 0: give the adapters something to differentiate
                    param.copy_(torch.linspace(-0.02, 0.02, param.numel()).view_as(param))
        forward_backward(model, _batches(11), nll_loss)
        models.append(model)
    eager, compiled = models
    assert is_compiled(compiled)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None and "lora_" not in name, name
            continue
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert list(merged_state_dict(compiled)) == list(merged_state_dict(eager))


def test_cache_calls_run_eager_and_compile_nothing():
    """Generation (a KV cache) goes around the compiled graph: same tokens, no compile."""
    eager, compiled = _pair()
    prompt = torch.tensor([[5, 9, 11, 3, 7]])
    before = _compiled_frames()
    with torch.no_grad():
        want = eager.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        got = compiled.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, want)
    assert _compiled_frames() == before


def test_checkpoints_keep_their_keys_and_reload(tmp_path):
    tokenizer = build_tokenizer()
    model = place_model(build_model("tiny-dense", vocab_size=len(tokenizer), seed=1), "cpu", compile=True)
    plain = build_model("tiny-dense", vocab_size=len(tokenizer), seed=2)
    assert is_compiled(model) and not is_compiled(plain)
    assert list(model.state_dict()) == list(plain.state_dict())  # no `_orig_mod.` prefixes
    path = save_checkpoint(tmp_path, 1, model, tokenizer)
    loaded = load_checkpoint(path, restore_rng=False).model
    assert list(loaded.state_dict()) == list(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)  # plain transformers reads it
    assert set(hf.state_dict()) == set(model.state_dict())


def test_compile_layers_is_idempotent_and_survives_pickling():
    import pickle

    model = compile_layers(compile_layers(build_model("tiny-dense", vocab_size=VOCAB, seed=0)))
    assert is_compiled(model)
    layer = model.model.layers[0]
    assert layer.forward.args == (layer,)  # bound once, to the layer itself
    again = pickle.loads(pickle.dumps(model))
    assert is_compiled(again) and again.model.layers[0].forward.args[0] is again.model.layers[0]


def test_compile_with_activation_checkpointing_is_refused():
    with pytest.raises(ValueError, match="train.compile with train.activation_checkpointing"):
        place_model(build_model("tiny-dense", vocab_size=VOCAB, seed=0), "cpu",
                    activation_checkpointing=True, compile=True)
    with pytest.raises(ConfigError, match="train.compile with train.activation_checkpointing"):
        validate_config({"train": {"compile": True, "activation_checkpointing": True}})
    assert validate_config({"train": {"compile": True}}).train.compile
    assert not validate_config({}).train.compile


def test_models_without_decoder_layers_are_refused_by_name():
    with pytest.raises(ValueError, match="train.compile: Linear has no decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_place_model_leaves_models_eager_by_default():
    model = place_model(build_model("tiny-dense", vocab_size=VOCAB, seed=0), "cpu")
    assert not is_compiled(model)
    assert not is_compiled(copy.deepcopy(model))
