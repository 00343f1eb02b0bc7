"""Per-token log-probabilities of the labels, computed chunk by chunk.

`log softmax(h · Wᵀ / τ)[label]` needs only one number per token, but the naive route builds a
[T, V] float32 logits tensor (T=8192, V=151,936: 5 GB) and autograd keeps it for backward.
`selective_log_softmax` instead runs over chunks of tokens: the forward keeps no [chunk, V]
tensor once the chunk is done, and the backward recomputes each chunk's logits from the saved
hidden states. The forward saves each token's logsumexp [T], so the backward's
d logp / d logits = onehot − exp(logits − lse) needs no reduction over V. Peak extra memory is
O(chunk × V).

Under autocast the matmul runs in the autocast dtype, like `nn.Linear` would, and the softmax
accumulates in float32. The elementwise work per chunk lives in training/logprob_kernels.py, eager
or compiled. `token_logprobs(kernels="auto")` compiles them where the model's decoder layers are
compiled (`train.compile`, models/compile.py) and the tokens are on CUDA: there the passes over
[chunk, V] are memory-bound and were 25% of an H100 train step (docs/BENCHMARKS_GPU.md). Like
the layers (train.compile unset = on for CUDA), they run compiled there by default
(benchmarks/bench_gpu.py, part `logprobs`, measures them). On the CPU the GEMMs dominate, the fused kernels gain little over the eager
in-place passes (benchmarks/bench_logprobs.py), and the compile would cost every short run and
test tens of seconds. The compiled functions take only the matmul output and [C] vectors (never
the weights), so LoRA, DDP/FSDP2 and the compiled layers do not reach them.
"""

from __future__ import annotations

import torch
from rlpipe.models.attention import model_hidden_states
from rlpipe.models.compile import is_compiled
from rlpipe.training import logprob_kernels as K
from rlpipe.training.fused_head import fused_logprobs, head_matmul_dtype, resolve_logprobs

IGNORE_INDEX = -100
KERNELS = ("auto", "compiled", "eager")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: the autocast dtype when autocast is on for this device, else the
    promoted input dtype (what `F.linear` would use)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(  # training/entropy.py reuses it
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


def use_fused_kernels(kernels: str, device: torch.device, compiled_model: bool = False) -> bool:
    """Whether `kernels` ("auto" | "compiled" | "eager") runs the compiled per-chunk kernels:
    "auto" does on CUDA for a model whose layers are compiled (see the module docstring)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}; got {kernels!r}")
    return kernels == "compiled" or (kernels == "auto" and compiled_model and device.type == "cuda")


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked log-softmax + gather; saves lse [T] and recomputes logits in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature, fused):  # noqa: D102
        cdtype = _compute_dtype(hidden, weight)
        acc = K.acc_dtype(cdtype)
        valid = labels != IGNORE_INDEX
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        n, scale = hidden.shape[0], 1.0 / temperature
        out = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdtype)
            b = None if bias is None else bias.to(acc)
            ws = None if fused else K.make_workspace(min(chunk_size, n), w.shape[0], cdtype, hidden.device)
            for start in range(0, n, chunk_size):
                sl = slice(start, start + chunk_size)
                out[sl], lse[sl] = K.chunk_forward(hidden[sl].to(cdtype), w, b, safe_labels[sl], scale, fused, ws)
            del ws
        out = out * valid
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, lse)
        ctx.chunk_size, ctx.scale, ctx.cdtype, ctx.fused = chunk_size, scale, cdtype, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        hidden, weight, bias, labels, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdtype, scale, fused = ctx.cdtype, ctx.scale, ctx.fused
        acc = K.acc_dtype(cdtype)
        # Ignored tokens get no gradient; 1/τ from the logits' scaling folds in here.
        g = grad_out.to(acc) * valid * scale
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdtype)
            b = None if bias is None else bias.to(acc)
            ws = None if fused else K.make_workspace(min(ctx.chunk_size, n), w.shape[0], cdtype, hidden.device)
            for start in range(0, n, ctx.chunk_size):
                sl = slice(start, start + ctx.chunk_size)
                h = hidden[sl].to(cdtype)
                grad_logits, gb = K.chunk_grad_logits(h, w, b, labels[sl], lse[sl], g[sl], scale, need_b, fused, ws)
                if need_b:
                    grad_b += gb
                if need_h:
                    grad_h[sl] = grad_logits @ w
                if need_w:
                    if grad_logits.dtype == acc:  # accumulate in place: no [V, H] temporary
                        grad_w.addmm_(grad_logits.t(), h)
                    else:
                        grad_w += grad_logits.t() @ h
                del grad_logits
            del ws
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def selective_log_softmax(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    kernels: str = "auto",
) -> torch.Tensor:
    """log softmax(hidden · Wᵀ (+ b) / temperature)[labels], chunk by chunk.

    hidden [T, H], lm_head_weight [V, H], labels int64 [T] (-100 = ignore), bias [V] | None
    → float32 [T] (float64 for float64 inputs), 0 where the label is -100. Differentiable in hidden, weight and bias;
    never materialises a [T, V] tensor. kernels: "compiled" or "eager" (training/logprob_kernels.py;
    "auto" is eager here: `token_logprobs` resolves it from the model).
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
    fused = use_fused_kernels(kernels, hidden.device)
    return _SelectiveLogSoftmax.apply(
        hidden, lm_head_weight, lm_head_bias, labels.long(), int(chunk_size), float(temperature), fused
    )


def head_logprobs(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                  chunk_size: int = 1024, kernels: str = "auto", head: str = "chunked") -> torch.Tensor:
    """The labels' log-probs [T] from the decoder's hidden states [T, H] through the model's LM
    head: `head` is `train.logprobs` ("auto" | "fused" | "chunked", training/fused_head.py), the
    chunked path wherever the fused one cannot run."""
    lm_head = model.get_output_embeddings()
    bias = getattr(lm_head, "bias", None)
    labels = labels.to(hidden.device)
    dtype = head_matmul_dtype(hidden, lm_head.weight)
    if resolve_logprobs(head, hidden.device.type, bias is not None, dtype=dtype) == "fused":
        return fused_logprobs(hidden, lm_head.weight, labels, temperature, IGNORE_INDEX)
    if kernels == "auto" and use_fused_kernels(kernels, hidden.device, hidden.is_cuda and is_compiled(model)):
        kernels = "compiled"
    return selective_log_softmax(hidden, lm_head.weight, labels, chunk_size=chunk_size, temperature=temperature,
                                 lm_head_bias=bias, kernels=kernels)


def token_logprobs(
    model: torch.nn.Module, batch, temperature: float = 1.0, chunk_size: int = 1024, kernels: str = "auto",
    head: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every label of a PackedBatch under `model`.

    Runs the decoder on the packed tokens (varlen attention), then the LM head (tied or not, bias
    if any): the chunked selective log-softmax, or the fused head where `head` asks and it can run.
    Returns (logprobs float32 [T], 0 at labels == -100; MoE router aux loss or None).
    kernels "auto": compiled on CUDA when the model's layers are (`train.compile`), else eager.
    """
    hidden, aux_loss = model_hidden_states(model, batch)
    return head_logprobs(model, hidden, batch.labels, temperature, chunk_size, kernels, head), aux_loss
