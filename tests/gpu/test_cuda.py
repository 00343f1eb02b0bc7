"""The CUDA path: the varlen kernel, training and the torch engine on a GPU.

Skipped with the reason where torch sees no CUDA device (the CPU tests of the device logic are in
tests/unit/test_device.py). Run on a GPU machine: `python -m pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.models.attention import flash_kernel, model_hidden_states, use_flash
from rlpipe.models.loading import autocast_context
from rlpipe.models.presets import build_model
from rlpipe.tasks.setup import place_model
from rlpipe.training.batch import Sequence, pack, pack_one
from rlpipe.training.logprobs import token_logprobs
from rlpipe.training.losses import nll_loss
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]
VOCAB = 97


def _model(preset: str, dtype: torch.dtype = torch.float32):
    model = build_model(preset, VOCAB, seed=1, pad_token_id=0, eos_token_id=1)
    return place_model(model, "cuda", str(dtype).removeprefix("torch."))


def _sequences(n: int, seed: int = 0, low: int = 5, high: int = 300) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(low, high, (1,), generator=g))
        tokens = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        out.append(Sequence(tokens=tokens, weights=[1.0] * length, sample_id=f"s{i}"))
    return out


def _groups(n_groups=4, group_size=6, seed=0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(20, 90, (1,), generator=g)),), generator=g).tolist()
        for ci in range(group_size):
            completion = torch.randint(2, VOCAB, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
            adv = float(torch.randn(1, generator=g))
            out.append(Sequence(tokens=prompt + completion, weights=[0.0] * len(prompt) + [adv] * len(completion),
                                logprobs=[0.0] * len(prompt) + [-1.0] * len(completion), reward=adv,
                                sample_id=f"g{gi}:{ci}", prefix_len=len(prompt)))
    return out


@pytest.mark.parametrize("preset", ["small-dense", "small-moe"])
def test_varlen_kernel_packed_equals_per_sequence(preset):
    assert flash_kernel() is not None, "this torch has no varlen kernel"
    model = _model(preset).eval()
    seqs = _sequences(12)
    packed = pack_one(seqs).to("cuda")
    with torch.no_grad(), autocast_context("cuda", True):
        assert use_flash(model)
        hidden, _ = model_hidden_states(model, packed)
        alone = [model_hidden_states(model, pack_one([s]).to("cuda"))[0] for s in seqs]
    per_token = (hidden.float() - torch.cat(alone).float()).abs().amax(-1)
    # bf16: one ulp at these magnitudes is ~1e-2. MoE: a rounding-level difference can flip a
    # token's top-2 experts (seen on a GPU: one outlier of 0.34 for small-moe, none for dense), so compare the bulk there
    bound = per_token.max() if preset.endswith("dense") else per_token.quantile(0.99)
    assert bound.item() < 5e-2, per_token.topk(5)
    with torch.no_grad():  # fp32 reference: the padded-bucket sdpa path
        assert not use_flash(model)
        reference, _ = model_hidden_states(model, packed)
    cos = torch.nn.functional.cosine_similarity(hidden.float(), reference, dim=-1)
    bound = cos.min() if preset.endswith("dense") else cos.median()
    assert bound.item() > 0.999


def test_varlen_kernel_shared_prefixes_equal_the_unshared_layout():
    model = _model("small-dense").eval()
    seqs = _groups()
    (shared,) = pack(seqs, 1 << 16)
    (plain,) = pack(seqs, 1 << 16, share_prefixes=False)
    assert shared.prefix_index is not None
    with torch.no_grad(), autocast_context("cuda", True):
        a, _ = token_logprobs(model, shared.to("cuda"))
        b, _ = token_logprobs(model, plain.to("cuda"))
    pick = lambda batch, lp: torch.cat([lp[batch.token_weights.to("cuda") != 0]])  # noqa: E731
    # completions appear in the same order in both layouts
    assert torch.allclose(pick(shared, a), pick(plain, b), atol=3e-2)


def test_varlen_kernel_gradients_match_the_fp32_reference():
    seqs = _groups(seed=3)
    loss_fn = build_rl_loss("reinforce")
    grads = {}
    for autocast in (True, False):
        model = _model("small-dense")
        forward_backward(model, pack(seqs, 4096), loss_fn, StepOptions(autocast=autocast))
        grads[autocast] = torch.cat([p.grad.flatten() for p in model.parameters()])
    cos = torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0).item()
    assert cos > 0.99


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_training_on_cuda_lowers_the_loss(weights_dtype):
    model = _model("small-dense", getattr(torch, weights_dtype))
    optimizer = build_optimizer(model, lr=3e-3)
    assert optimizer.defaults["fused"]  # one fused AdamW kernel on CUDA
    batches = pack(_sequences(16, seed=5), 2048)
    losses = []
    for _ in range(8):
        metrics = forward_backward(model, batches, nll_loss, StepOptions(autocast=True))
        optim_step(model, optimizer, None, max_grad_norm=1.0)
        losses.append(metrics["loss"])
    assert losses[-1] < losses[0] - 0.1
    state = optimizer.state[next(model.parameters())]
    assert state["exp_avg"].device.type == "cuda" and state["exp_avg"].dtype == getattr(torch, weights_dtype)


def test_activation_checkpointing_gives_the_same_gradients_on_cuda():
    seqs = _sequences(8, seed=2)
    grads = []
    for checkpointing in (False, True):
        model = build_model("small-dense", VOCAB, seed=1, pad_token_id=0, eos_token_id=1)
        place_model(model, "cuda", activation_checkpointing=checkpointing)
        forward_backward(model, pack(seqs, 4096), nll_loss, StepOptions(autocast=True))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # the flash backward accumulates with atomics: equal up to run-to-run bf16 noise
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item() > 0.9999


def test_engine_on_cuda_logprobs_match_the_trainer():
    model = _model("small-dense").eval()
    engine = TorchEngine(model, dtype=torch.bfloat16)
    assert engine.device.type == "cuda"
    prompts = [s.tokens[:20] for s in _sequences(6, seed=7, low=25, high=40)]
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=24, seed=0))
    seqs = [Sequence(tokens=p + c.tokens, weights=[0.0] * len(p) + [1.0] * len(c.tokens),
                     logprobs=[0.0] * len(p) + c.logprobs)
            for p, cs in zip(prompts, out, strict=True) for c in cs]
    batch = pack_one(seqs).to("cuda")
    with torch.no_grad(), autocast_context("cuda", True):
        trainer, _ = token_logprobs(model, batch)
    mask = batch.token_weights != 0
    gap = (trainer[mask].float() - batch.log_probs[mask]).abs()
    # bf16 sampler vs bf16-autocast trainer: the mismatch TIS/PPO ratios absorb, not a bug
    assert gap.mean().item() < 0.05, gap.mean().item()


# train.compile (models/compile.py): compiled decoder layers on CUDA, bf16 autocast, varlen flash

def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_compiled_layers_train_like_eager_on_cuda(weights_dtype):
    """fp32 master weights and pure bf16: same losses and gradients (up to bf16 and flash-atomics
    noise) over a few optimizer steps, no recompile for micro-batches of new lengths, and each
    layer one graph with the varlen kernel inside (no graph break)."""
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    models = [place_model(build_model("small-dense", VOCAB, seed=1, pad_token_id=0, eos_token_id=1), "cuda",
                          weights_dtype, compile=compile) for compile in (False, True)]
    optimizers = [build_optimizer(m, lr=1e-3) for m in models]
    frames, losses = None, [[], []]
    for step in range(4):
        batches = pack(_sequences(16, seed=20 + step), 1024)  # micro-batch lengths change every step
        if step == 0:  # two lengths: the shapes turn dynamic within the first step
            assert len({b.n_tokens for b in batches}) >= 2
        grads = []
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            with autocast_context("cuda", True):
                assert use_flash(model)
            losses[i].append(forward_backward(model, batches, nll_loss, StepOptions(autocast=True))["loss"])
            grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
            optim_step(model, optimizer, None, max_grad_norm=1.0)
        cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
        assert cos > 0.999, (step, cos)
        assert losses[1][-1] == pytest.approx(losses[0][-1], rel=2e-2), step
        frames = _compiled_frames() if frames is None else frames
    assert frames > 0, "nothing was compiled"
    assert _compiled_frames() == frames, "a micro-batch of a new length recompiled"
    assert sum(counters["graph_break"].values()) == breaks_before, dict(counters["graph_break"])


def test_engine_samples_the_same_from_a_compiled_model_on_cuda():
    """The engine reads the compiled model's weights (fast path) or runs it with a KV cache
    (eager layers): greedy tokens equal the eager model's."""
    eager = _model("small-dense").eval()
    compiled = place_model(build_model("small-dense", VOCAB, seed=1, pad_token_id=0, eos_token_id=1), "cuda",
                           compile=True).eval()
    prompts = [s.tokens[:20] for s in _sequences(4, seed=9, low=25, high=40)]
    params = SamplingParams(greedy=True, max_new_tokens=16)
    outs = [TorchEngine(m, dtype=torch.bfloat16).generate(prompts, params) for m in (eager, compiled)]
    assert [[c.tokens for c in g] for g in outs[0]] == [[c.tokens for c in g] for g in outs[1]]


def test_compiled_logprob_kernels_match_float64_on_cuda():
    """kernels="compiled" (what "auto" runs on CUDA with train.compile; training/logprob_kernels.py):
    under bf16 autocast its log-probs and gradients match a float64 full-logits reference from the
    same bf16-rounded inputs, and the eager kernels; a new token count does not recompile."""
    from rlpipe.training.logprobs import selective_log_softmax, use_fused_kernels

    assert use_fused_kernels("auto", torch.device("cuda"), compiled_model=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 3000, 256, 32_000  # a partial last chunk (3,000 = 2 × 1,024 + 952)
    hidden = torch.randn(T, H, device="cuda", generator=g)
    weight = torch.randn(V, H, device="cuda", generator=g) / H**0.5 * 3
    bias = torch.randn(V, device="cuda", generator=g)
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels[::9] = -100
    upstream = torch.linspace(-1.0, 2.0, T, device="cuda")

    def run(kernels, n=T):
        leaves = [hidden[:n].clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = selective_log_softmax(leaves[0], leaves[1], labels[:n], 1024, 0.7, leaves[2], kernels=kernels)
        (out * upstream[:n]).sum().backward()
        return out, [t.grad for t in leaves]

    out, grads = run("compiled")
    refs = [hidden.bfloat16().double().requires_grad_(), weight.bfloat16().double().requires_grad_(),
            bias.double().requires_grad_()]
    logits = (refs[0] @ refs[1].t() + refs[2]) / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ref = torch.where(labels != -100, ref, torch.zeros_like(ref))
    (ref * upstream.double()).sum().backward()
    assert out.dtype == torch.float32 and torch.all(out[labels == -100] == 0)
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.02)
    for name, a, r in zip(("hidden", "weight", "bias"), grads, refs, strict=True):
        err = (a.double() - r.grad).abs().max() / r.grad.abs().max()
        assert err < 0.02, f"{name}: max error {err:.4f} of the gradient's scale"
    eager_out, eager_grads = run("eager")
    torch.testing.assert_close(out, eager_out, atol=1e-4, rtol=0)
    for a, b in zip(grads, eager_grads, strict=True):  # a bf16 ulp here and there (matmul outputs)
        assert (a - b).abs().max() / b.abs().max() < 5e-3
    with torch._dynamo.config.patch(error_on_recompile=True):
        run("compiled", n=T - 517)


# train.fused = "liger" (training/fused.py): Liger Kernel's RMSNorm, rotary and SwiGLU in a Qwen3


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_liger_kernels_give_the_unpatched_log_probs_and_gradients(preset):
    """Needs liger-kernel (pip install 'rlpipe[liger]'); skipped, saying so, without it. Liger's
    rotary patch is process-wide, so the unpatched figures are taken first."""
    pytest.importorskip("liger_kernel", reason="train.fused = 'liger' needs liger-kernel (pip install 'rlpipe[liger]')")
    from rlpipe.training.fused import apply_fused_kernels

    (packed,) = pack(_sequences(6, seed=3, high=120), token_budget=4096)

    def logprobs_and_grads(model):
        batch = packed.to(next(model.parameters()).device)  # every tensor where the model is
        logprobs, aux = token_logprobs(model, batch, temperature=0.8)
        loss = -(batch.token_weights * logprobs).sum() + (aux if aux is not None else 0.0)
        loss.backward()
        return logprobs.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    plain = _model(preset)
    expected, expected_grads = logprobs_and_grads(plain)
    patched = _model(preset)
    assert apply_fused_kernels(patched, "liger") == "liger"
    got, grads = logprobs_and_grads(patched)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-4, rtol=2e-3, msg=name)


# train.logprobs = "fused" (training/fused_head.py): Cut Cross-Entropy's kernels against the chunked head


@pytest.mark.parametrize("tied", [True, False])
def test_fused_head_gives_the_chunked_log_probs_and_gradients(tied):
    """Needs cut-cross-entropy (pip install 'rlpipe[cce]'); skipped, saying so, without it. A
    weighted, tempered loss with ignored labels under bf16 autocast (the GPU default): log-probs
    and every parameter's gradient (gradient filtering off) equal the chunked head's, where both
    heads run the matmul in bf16 and 1/τ rounds on the bf16 embeddings in the fused head. A float32
    head (no autocast) runs chunked: the library's backward takes bf16 or fp16 embeddings only
    (it asserts so)."""
    pytest.importorskip("cut_cross_entropy", reason="train.logprobs = 'fused' needs cut-cross-entropy "
                                                    "(pip install 'rlpipe[cce]')")
    from rlpipe.training.fused_head import resolve_logprobs

    assert resolve_logprobs("fused", "cuda") == "fused"
    assert resolve_logprobs("fused", "cuda", dtype=torch.float32) == "chunked"
    (packed,) = pack(_sequences(6, seed=5, high=200), token_budget=4096)
    batch = packed.to("cuda")
    weights = torch.linspace(-1.5, 2.0, batch.labels.shape[0], device="cuda")  # signed, as advantages are

    def run(head):
        model = build_model("tiny-dense", VOCAB, seed=2, pad_token_id=0, eos_token_id=1, tie_word_embeddings=tied)
        place_model(model, "cuda")
        with autocast_context(torch.device("cuda"), True):
            logprobs, _ = token_logprobs(model, batch, temperature=0.7, head=head)
        (-(weights * logprobs).sum()).backward()
        return logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}

    want, want_grads = run("chunked")
    got, grads = run("fused")
    assert (got[batch.labels == -100] == 0).all()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)
    for name, grad in want_grads.items():
        err = (grads[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-12)
        assert err < 2e-2, f"{name}: max error {err:.2e} of the gradient's scale"
