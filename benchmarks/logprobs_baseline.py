"""The selective log-softmax as it was before the saved-logsumexp / fused-kernel change (commit
415f58f, training/logprobs.py): the baseline `bench_logprobs` compares the current one against.

Forward: per chunk, a fresh float32 [C, V] logits tensor, then amax, gather, sub, exp, sum, log.
Backward: recompute the logits, then amax, sub, exp, sum, div, mul, scatter_add, cast. Frozen
here on purpose; do not use it outside benchmarks.
"""

from __future__ import annotations

import torch
from rlpipe.training.logprobs import IGNORE_INDEX, _compute_dtype


def _chunk_logits(
    h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """[C, H] · [V, H]ᵀ → logits [C, V] in float32 (float64 for float64 inputs), ÷ temperature."""
    logits = h @ w.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if bias is not None:
        logits += bias.to(logits.dtype)
    if temperature != 1.0:
        logits /= temperature
    return logits


def _log_softmax_gather_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[labels] for logits [C, V] → [C]; overwrites logits (in-place ops keep
    the peak at one [C, V] tensor, where log_softmax + gather would hold two)."""
    row_max = logits.amax(dim=-1, keepdim=True)
    picked = logits.gather(1, labels[:, None]) - row_max
    lse = logits.sub_(row_max).exp_().sum(dim=-1, keepdim=True).log_()
    return (picked - lse).squeeze(1)


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, in place (returns logits)."""
    row_max = logits.amax(dim=-1, keepdim=True)
    logits.sub_(row_max).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True))


class OldSelectiveLogSoftmax(torch.autograd.Function):
    """Chunked log-softmax + gather with a recomputing backward (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature):  # noqa: D102
        cdtype = _compute_dtype(hidden, weight)
        valid = labels != IGNORE_INDEX
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        out_dtype = torch.promote_types(cdtype, torch.float32)
        out = torch.zeros(hidden.shape[0], dtype=out_dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdtype)
            for start in range(0, hidden.shape[0], chunk_size):
                sl = slice(start, start + chunk_size)
                logits = _chunk_logits(hidden[sl].to(cdtype), w, bias, temperature)
                out[sl] = _log_softmax_gather_(logits, safe_labels[sl])
                del logits
        out = out * valid
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid)
        ctx.chunk_size, ctx.temperature, ctx.cdtype = chunk_size, temperature, cdtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        hidden, weight, bias, labels, valid = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdtype, temperature = ctx.cdtype, ctx.temperature
        # Gradients of ignored tokens are zero; 1/τ from the logits' scaling folds in here.
        acc = torch.promote_types(cdtype, torch.float32)
        g = (grad_out.to(acc) * valid) / temperature
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdtype)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                sl = slice(start, start + ctx.chunk_size)
                h = hidden[sl].to(cdtype)
                # d logp[label] / d logits = onehot(label) − softmax; scaled by the incoming grad.
                grad_logits = _softmax_(_chunk_logits(h, w, bias, temperature))
                grad_logits.mul_(-g[sl, None])
                grad_logits.scatter_add_(1, labels[sl, None], g[sl, None])
                if need_b:
                    grad_b += grad_logits.sum(0)
                grad_logits = grad_logits.to(cdtype)
                if need_h:
                    grad_h[sl] = (grad_logits @ w).to(hidden.dtype)
                if need_w:
                    grad_w += (grad_logits.t() @ h).to(acc)
                del grad_logits
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def old_selective_log_softmax(hidden, lm_head_weight, labels, chunk_size=1024, temperature=1.0, lm_head_bias=None):
    """The previous `training.logprobs.selective_log_softmax` (no argument checks)."""
    return OldSelectiveLogSoftmax.apply(hidden, lm_head_weight, lm_head_bias, labels.long(), int(chunk_size),
                                        float(temperature))
