"""The training step against an independent float64 reference: a check that holds on every machine.

The product's step (float32): pack the sequences (shared prompts, several micro-batches), the
chunked log-probs at a temperature, the RL loss with the token normaliser, gradient accumulation,
clipping and AdamW. The reference (float64): the same weights in a float64 copy of the model, each
sequence run alone and unpacked through the plain Hugging Face forward, log_softmax, −A·log π
summed over the loss tokens and divided by their count, autograd; then clipping and the AdamW
update written out from their definitions.

Tolerances come from float32 rounding, u = 2⁻²⁴: a result of a few hundred float32 operations in
sequence (dot products of the hidden width, a few layers, softmax, their backward) carries a
relative error of at most a few thousand u in the worst case, so loss and gradients must agree
within RTOL = 4096 u ≈ 2.4e-4 of their scale; a wrong normaliser, temperature, shifted target,
lost micro-batch or prefix shared across sequences by mistake is off by 1e-2 or more. The
optimizer update is checked on the product's own float32 gradients (Adam's first step is
±lr whatever the gradient's size, so weights after it cannot show a gradient's error): each
weight within 16 u of its magnitude plus lr (a handful of elementwise float32 operations).
"""

from __future__ import annotations

import copy
import math

import torch
from rlpipe.models.presets import build_model
from rlpipe.training.batch import Sequence, pack
from rlpipe.training.rl_loss import build_rl_loss
from rlpipe.training.step import StepOptions, build_optimizer, forward_backward, optim_step

VOCAB = 64
U = 2.0 ** -24  # float32 unit roundoff
RTOL = 4096 * U
TEMPERATURE = 0.7
LR, BETAS, EPS, MAX_NORM = 1e-3, (0.9, 0.95), 1e-8, 1.0


def rl_sequences(seed: int) -> list[Sequence]:
    """Groups of completions sharing a prompt, one advantage per completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(4):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(2, 10, (1,), generator=g))
            advantage = float(torch.randn(1, generator=g))
            out.append(Sequence(tokens=prompt + torch.randint(1, VOCAB, (n,), generator=g).tolist(),
                                weights=[0.0] * len(prompt) + [advantage] * n, prefix_len=len(prompt),
                                loss_mask=[False] * len(prompt) + [True] * n))
    return out


def reference_loss(model64: torch.nn.Module, sequences: list[Sequence]) -> torch.Tensor:
    """Σ over loss tokens of −A·log π(token | earlier tokens) at TEMPERATURE, ÷ their count; float64."""
    loss_tokens = sum(sum(s.loss_mask) for s in sequences)
    total = torch.zeros((), dtype=torch.float64)
    for s in sequences:
        ids = torch.tensor(s.tokens)
        logits = model64(input_ids=ids[None]).logits[0, :-1] / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None])[:, 0]
        mask = torch.tensor(s.loss_mask[1:])
        total = total - (torch.tensor(s.weights[1:], dtype=torch.float64) * logp)[mask].sum()
    return total / loss_tokens


def reference_update(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clip the gradients to MAX_NORM (torch's rule: × max_norm / (norm + 1e-6) when above), then
    AdamW's first step without decay: w − lr · m̂ / (√v̂ + eps); float64."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    out = {}
    for name, w in weights.items():
        g = grads[name].double() * coef
        m_hat = (1 - BETAS[0]) * g / (1 - BETAS[0])
        v_hat = (1 - BETAS[1]) * g * g / (1 - BETAS[1])
        out[name] = w.double() - LR * m_hat / (v_hat.sqrt() + EPS)
    return out


def product_step(model: torch.nn.Module, sequences: list[Sequence], normaliser: str = "token"):
    """One step as the trainer runs it: loss, float32 gradients, then clip + AdamW."""
    batches = pack(sequences, 48)
    assert len(batches) >= 2, "the step must accumulate over several micro-batches"
    metrics = forward_backward(model, batches, build_rl_loss("reinforce"),
                               StepOptions(normaliser=normaliser, temperature=TEMPERATURE))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optim_step(model, build_optimizer(model, lr=LR, betas=BETAS, eps=EPS), None, max_grad_norm=MAX_NORM)
    return metrics["loss"], grads


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over parameters of max|got − want| / max|want| (the parameter's gradient scale)."""
    return max(((got[n].double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30), n)
               for n, w in want.items())


def test_a_training_step_equals_a_float64_reference_within_float32_rounding():
    torch.manual_seed(0)
    model = build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    model64 = copy.deepcopy(model).double()
    sequences = rl_sequences(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    want_loss = reference_loss(model64, sequences)
    want_loss.backward()
    want_grads = {n: p.grad for n, p in model64.named_parameters()}
    loss, grads = product_step(model, sequences)

    assert abs(loss - want_loss.item()) <= RTOL * abs(want_loss.item()), (loss, want_loss.item())
    assert set(grads) == set(want_grads)
    worst, name = worst_relative(grads, want_grads)
    assert worst <= RTOL, f"{name}: gradient off by {worst:.3g} of its scale (tolerance {RTOL:.3g})"

    expected = reference_update(before, grads)
    for n, p in model.named_parameters():
        bound = 16 * U * (expected[n].abs() + LR)
        assert ((p.detach().double() - expected[n]).abs() <= bound).all(), n


def test_the_reference_tells_a_wrong_normaliser_apart():
    """The tolerance is far below what a wrong step changes: the sequence normaliser (a mean of
    per-sequence means) gives other gradients, which the check above must refuse."""
    model = build_model("tiny-dense", VOCAB, seed=0, pad_token_id=0, eos_token_id=0)
    model64 = copy.deepcopy(model).double()
    sequences = rl_sequences(1)
    reference_loss(model64, sequences).backward()
    _, grads = product_step(model, sequences, normaliser="sequence")
    worst, _ = worst_relative(grads, {n: p.grad for n, p in model64.named_parameters()})
    assert worst > 100 * RTOL
