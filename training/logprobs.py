"""Per-token log-probabilities of the labels, computed chunk by chunk.

`log softmax(h · Wᵀ / τ)[label]` needs only one number per token, but the naive route builds a
[T, V] float32 logits tensor (T=8192, V=151,936: 5 GB) and autograd keeps it for backward.
`selective_log_softmax` instead runs over chunks of tokens: the forward keeps no [chunk, V]
tensor once the chunk is done, and the backward recomputes each chunk's logits from the saved
hidden states (d logp / d logits = onehot − softmax). Peak extra memory is O(chunk × V).

Under autocast the matmul runs in the autocast dtype, like `nn.Linear` would, and each chunk's
logits are upcast to float32 before the softmax.
"""

from __future__ import annotations

import torch

from models.attention import model_hidden_states

IGNORE_INDEX = -100


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: the autocast dtype when autocast is on for this device, else the
    promoted input dtype (what `F.linear` would use)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


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


class _SelectiveLogSoftmax(torch.autograd.Function):
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


def selective_log_softmax(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax(hidden · Wᵀ (+ b) / temperature)[labels], chunk by chunk.

    hidden [T, H], lm_head_weight [V, H], labels int64 [T] (-100 = ignore), bias [V] | None
    → float32 [T] (float64 for float64 inputs), 0 where the label is -100. Differentiable in hidden, weight and bias;
    never materialises a [T, V] tensor.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H] and lm_head_weight [V, H]; got {tuple(hidden.shape)} "
            f"and {tuple(lm_head_weight.shape)}"
        )
    if hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden {tuple(hidden.shape)} vs lm_head_weight "
            f"{tuple(lm_head_weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T={hidden.shape[0]}]; got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    return _SelectiveLogSoftmax.apply(
        hidden, lm_head_weight, lm_head_bias, labels.long(), int(chunk_size), float(temperature)
    )


def token_logprobs(
    model: torch.nn.Module, batch, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every label of a PackedBatch under `model`.

    Runs the decoder on the packed tokens (varlen attention), then the chunked selective
    log-softmax against the LM head (tied or not, bias if any).
    Returns (logprobs float32 [T], 0 at labels == -100; MoE router aux loss or None).
    """
    hidden, aux_loss = model_hidden_states(model, batch)
    head = model.get_output_embeddings()
    labels = batch.labels.to(hidden.device)
    logprobs = selective_log_softmax(
        hidden,
        head.weight,
        labels,
        chunk_size=chunk_size,
        temperature=temperature,
        lm_head_bias=getattr(head, "bias", None),
    )
    return logprobs, aux_loss
