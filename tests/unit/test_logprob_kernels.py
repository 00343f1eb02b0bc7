"""The eager and compiled per-chunk kernels of the selective log-softmax (training/logprob_kernels.py)
against a float64 full-logits reference: values and gradients in hidden, weight and bias.

The compiled kernels run under kernels="auto" only on CUDA with train.compile; here the same compiled functions run
on CPU tensors (kernels="compiled"), so their arithmetic is checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.training.logprobs import selective_log_softmax, use_fused_kernels


def _reference(hidden, weight, labels, temperature=1.0, bias=None):
    """log_softmax over the full [T, V] logits in float64, 0 at ignored labels."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels != -100, logp, torch.zeros_like(logp))


def _inputs(T=53, H=24, V=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 3  # logits of a few units, a peaked softmax
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::7] = -100
    return hidden, weight, bias, labels


def _run(kernels, chunk_size, temperature, with_bias, autocast=False, T=53):
    """(out, grads of hidden/weight/bias) of the chunked version, and the same of the reference
    computed from the inputs the matmul really saw (bf16-rounded under autocast)."""
    hidden, weight, bias, labels = _inputs(T=T)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_(),
              bias.clone().requires_grad_() if with_bias else None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = selective_log_softmax(leaves[0], leaves[1], labels, chunk_size, temperature, leaves[2], kernels=kernels)
    seen = [t.to(torch.bfloat16) if autocast else t for t in (hidden, weight)]
    refs = [seen[0].double().requires_grad_(), seen[1].double().requires_grad_(),
            bias.double().requires_grad_() if with_bias else None]
    ref = _reference(refs[0], refs[1], labels, temperature, refs[2])
    upstream = torch.linspace(-1.0, 2.0, labels.numel())  # non-uniform, as a weighted loss gives
    (out * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    grads = [t.grad if t is not None else None for t in leaves]
    ref_grads = [t.grad if t is not None else None for t in refs]
    return out, ref, grads, ref_grads, labels


CASES = [  # (chunk_size, temperature, with_bias): one token per chunk, a partial last chunk, chunk > T
    (1, 1.0, False),
    (16, 0.7, True),
    (16, 1.0, False),
    (1024, 1.3, True),
]
# compiling the kernels takes seconds each (a shape, temperature or bias is a graph of its own)
COMPILED = pytest.param("compiled", marks=pytest.mark.slow)


@pytest.mark.parametrize("kernels", ["eager", COMPILED])
@pytest.mark.parametrize(("chunk_size", "temperature", "with_bias"), CASES)
def test_float32_matches_float64_reference(kernels, chunk_size, temperature, with_bias):
    out, ref, grads, ref_grads, labels = _run(kernels, chunk_size, temperature, with_bias)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    assert torch.all(out[labels == -100] == 0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    for name, a, b in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kernels", ["eager", COMPILED])
def test_bf16_autocast_matches_reference(kernels):
    """Under autocast the logits are rounded to bf16 (8 bits of mantissa) once, by the matmul;
    the softmax accumulates in float32 and grad_logits are rounded to bf16 once."""
    out, ref, grads, ref_grads, labels = _run(kernels, 16, 0.7, True, autocast=True)
    assert out.dtype == torch.float32
    assert torch.all(out[labels == -100] == 0)
    # logits of |z| ≲ 10 rounded to bf16: errors of a few 0.01 in a log-prob
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.02)
    for name, a, b in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        # relative to the gradient's scale: bf16 rounding of grad_logits and of the matmuls
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < 0.02, f"{name}: max error {err:.4f} of the gradient's scale"


@pytest.mark.slow
def test_bf16_compiled_equals_eager():
    """Both kernels see the same bf16 matmul output: only float32 summation order differs."""
    a = _run("eager", 16, 0.7, True, autocast=True)
    b = _run("compiled", 16, 0.7, True, autocast=True)
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=0)
    for ga, gb in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-3, rtol=1e-2)


def test_compiled_kernels_do_not_recompile_for_new_lengths():
    """dynamic=True: after one call, other token counts (other last-chunk lengths) reuse the graphs."""
    _run("compiled", 16, 0.7, True, T=53)  # compiles, or reuses what other tests compiled
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (40, 77, 16):
            out, ref, *_ = _run("compiled", 16, 0.7, True, T=T)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_kernels_choice():
    assert not use_fused_kernels("auto", torch.device("cpu"), compiled_model=True)
    assert not use_fused_kernels("auto", torch.device("cuda"))  # opt-in with train.compile
    assert use_fused_kernels("auto", torch.device("cuda"), compiled_model=True)
    assert use_fused_kernels("compiled", torch.device("cpu"))
    assert not use_fused_kernels("eager", torch.device("cuda"))
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="kernels"):
        selective_log_softmax(hidden, weight, labels, kernels="triton")


def test_float64_stays_float64_in_both_kernels():
    hidden, weight, bias, labels = _inputs(T=11, H=5, V=13)
    h, w, b = (t.double() for t in (hidden, weight, bias))
    for kernels in ("eager", "compiled"):
        out = selective_log_softmax(h, w, labels, 4, 0.9, b, kernels=kernels)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, _reference(h, w, labels, 0.9, b), atol=1e-12, rtol=0)
